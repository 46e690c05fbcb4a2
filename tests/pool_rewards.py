"""Reward functions that misbehave, for the reward-pool tests (``rewards: [{function: "pool_rewards:..."}]``).

The files they write are named by the record (``marker``, ``outside``): the tests check that the files
never appear."""

from __future__ import annotations

import os
import signal
import time


def sleeps_forever(prompt, completion, **_):
    """Never answers for a completion that starts with ``hang``; 1.0 for the others."""
    if completion.startswith("hang"):
        time.sleep(10**6)
    return 1.0


def hangs_on_x(prompt, completion, answer, **_):
    """The GRPO run's reward: never answers for a completion ending in ``x`` (the rollout file's fourth
    completion of each prompt: the answer padded with x), else 1.0 for the exact answer."""
    if completion.endswith("x"):
        time.sleep(10**6)
    return float(completion.strip() == answer)


def forks(prompt, completion, marker, **_):
    """Starts a child that writes ``marker`` half a second later, and returns at once."""
    if os.fork() == 0:
        time.sleep(0.5)
        with open(marker, "w") as f:
            f.write("the child outlived its reward call")
        os._exit(0)
    return 1.0


def forks_and_hangs(prompt, completion, marker, **_):
    """Starts a child in a session of its own that writes ``marker`` a second later, then never answers."""
    if os.fork() == 0:
        os.setsid()
        time.sleep(1.0)
        with open(marker, "w") as f:
            f.write("the child outlived its killed worker")
        os._exit(0)
    time.sleep(10**6)


def writes_outside(prompt, completion, outside, **_):
    """Writes ``outside`` (a path outside the worker's temp dir); 1.0 whether or not it could."""
    try:
        with open(outside, "w") as f:
            f.write("escaped")
    except OSError:
        pass
    return 1.0


def wrong_type(prompt, completion, **_):
    return "high"


def beyond_float(prompt, completion, **_):
    """An int no float holds (float() of it overflows)."""
    return 10**400


def raises(prompt, completion, **_):
    raise ValueError("boom")


def dies(prompt, completion, **_):
    """The worker is killed mid-call (as the kernel's out-of-memory killer would)."""
    os.kill(os.getpid(), signal.SIGKILL)
