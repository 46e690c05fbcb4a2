"""Reward functions in worker processes (``rl.reward_workers``): a call past ``timeout_s`` is killed
and counted, never stalling the step; what a reward forks dies with its call; a sandboxed reward
writes nothing outside; wrong values read as they do in process; the recipe keys are checked."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from grpo_runs import grpo_recipe
from helpers import metrics, train_inproc

from llmft import stop
from llmft.errors import UserError
from llmft.objectives.rewards import Rewards
from llmft.plan.rl import RewardEntry, reward_entries, reward_problems
from llmft.scoring.probe import bwrap_problem

TESTS = Path(__file__).resolve().parents[1]
SANDBOXES = ["none", pytest.param("bwrap", marks=pytest.mark.skipif(bwrap_problem() is not None, reason="no bwrap"))]


def _rewards(function: str, workers: int = 2, **entry) -> Rewards:
    return Rewards([{"function": f"pool_rewards:{function}", **entry}], torch.device("cpu"), None, workers=workers)


def _score(rewards: Rewards, completions: list[str], **fields) -> torch.Tensor:
    prompts = [f"p{i}" for i in range(len(completions))]
    return rewards.score(prompts, completions, [{"prompt": p, **fields} for p in prompts])[:, 0]


def _line(function: str) -> int:
    text = (TESTS / "pool_rewards.py").read_text().splitlines()
    return next(i for i, line in enumerate(text, 1) if line.startswith(f"def {function}("))


@pytest.mark.timeout(60)  # the hung calls end at their 1 s deadline, or the test fails here
@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_reward_that_sleeps_forever_is_no_opinion_within_its_deadline(sandbox):
    rewards = _rewards("sleeps_forever", timeout_s=1, sandbox=sandbox)
    try:
        assert _score(rewards, ["a", "b"]).tolist() == [1.0, 1.0]  # the workers are up: only calls are timed
        # two workers: both hangs run side by side, each killed at 1 s, the other calls answer meanwhile
        scores = _score(rewards, ["a", "hang 1", "b", "hang 2", "c"])
        assert scores.isnan().tolist() == [False, True, False, True, False]
        assert scores[~scores.isnan()].tolist() == [1.0, 1.0, 1.0]
        assert rewards.event_metrics() == {
            "reward_timeouts/sleeps_forever": 2.0,
            "reward_failures/sleeps_forever": 0.0,
        }
        assert _score(rewards, ["a", "b"]).tolist() == [1.0, 1.0]  # the replaced workers serve the next step
        assert rewards.event_metrics()["reward_timeouts/sleeps_forever"] == 0.0
    finally:
        rewards.close()


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_what_a_reward_forks_dies_with_its_call(tmp_path, sandbox):
    returns, hangs = tmp_path / "returned.txt", tmp_path / "hung.txt"
    rewards = _rewards("forks", sandbox=sandbox)
    hanging = _rewards("forks_and_hangs", timeout_s=0.5, sandbox=sandbox)
    try:
        assert _score(rewards, ["a", "b"], marker=str(returns)).tolist() == [1.0, 1.0]
        assert _score(hanging, ["a"], marker=str(hangs)).isnan().tolist() == [True]
        time.sleep(1.5)  # the children would have written by now
        assert not returns.exists() and not hangs.exists()
        assert hanging.event_metrics()["reward_timeouts/forks_and_hangs"] == 1.0
    finally:
        rewards.close()
        hanging.close()


@pytest.mark.skipif(bwrap_problem() is not None, reason="no bwrap")
def test_a_sandboxed_reward_writes_nothing_outside_its_temp_dir(tmp_path):
    outside = tmp_path / "outside.txt"
    rewards = _rewards("writes_outside")  # default sandbox: bwrap, where it works
    try:
        assert _score(rewards, ["a"], outside=str(outside)).tolist() == [1.0]
        assert not outside.exists()
        assert _score(rewards, ["a"], outside=str(TESTS / "pool-rewards-escaped.txt")).tolist() == [1.0]
        assert not (TESTS / "pool-rewards-escaped.txt").exists()
    finally:
        rewards.close()
    unconfined = _rewards("writes_outside", sandbox="none")  # what the sandbox stops
    try:
        _score(unconfined, ["a"], outside=str(outside))
        assert outside.read_text() == "escaped"
    finally:
        unconfined.close()


@pytest.mark.timeout(30)  # the call's own deadline is 60 s: only the stop ends it in time
def test_a_stop_request_ends_a_hung_call_at_once():
    """SIGTERM while a call hangs: the call is dropped within the pool's poll and the step abandoned
    (in the training process the same call would hold the run until it is killed)."""
    rewards = _rewards("sleeps_forever", workers=1, sandbox="none")  # the default 60 s deadline
    try:
        with stop.installed("SIGUSR1", stop.TRAINING):
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            with pytest.raises(stop.Abandoned, match="scoring"):
                _score(rewards, ["hang"])
        assert _score(rewards, ["a"]).tolist() == [1.0]  # a fresh worker took the dropped one's place
    finally:
        rewards.close()


def test_on_timeout_error_stops_naming_the_reward_and_the_record():
    rewards = _rewards("sleeps_forever", timeout_s=0.5, on_timeout="error", sandbox="none")
    try:
        with pytest.raises(UserError) as e:
            _score(rewards, ["a", "hang"])
    finally:
        rewards.close()
    assert str(e.value) == (
        f"rewards[0].function: sleeps_forever ({TESTS / 'pool_rewards.py'}:{_line('sleeps_forever')}) did not "
        "answer within timeout_s 0.5 s for the record with prompt 'p1'; no optimizer step was taken and the "
        "last checkpoint is untouched. Make the reward answer within its deadline (raise rewards[0].timeout_s, "
        "or on_timeout: none to count such a call as no opinion), then run again: checkpoint.resume=auto "
        "continues from the last checkpoint."
    )


@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize("function", ["wrong_type", "beyond_float", "raises"])
def test_a_bad_value_or_an_error_reads_as_it_does_in_process(function, sandbox):
    def message(workers: int) -> str:
        rewards = _rewards(function, workers=workers, **({"sandbox": sandbox} if workers else {}))
        try:
            with pytest.raises(UserError) as e:
                _score(rewards, ["a", "b"])
        finally:
            rewards.close()
        return str(e.value)

    here, pooled = message(0), message(1)
    where = f"{TESTS / 'pool_rewards.py'}:{_line(function)}"
    what = {
        "wrong_type": "returned 'high'",
        "beyond_float": f"returned {repr(10**400)[:200]}...",  # no float holds it; its repr cut to 200
        "raises": "raised ValueError: boom",
    }[function]
    assert here.startswith(f"rewards[0].function: {function} ({where}) {what}")
    if function != "raises" or sandbox == "none":
        assert pooled == here
    else:  # an error in the sandbox says where it ran, and how to run it unconfined
        assert pooled.startswith(here)
        assert pooled.endswith("rewards[0].sandbox: none runs it unconfined.")


def test_a_worker_that_dies_is_no_opinion_and_counted():
    rewards = _rewards("dies", workers=1, sandbox="none")
    try:
        assert _score(rewards, ["a", "b"]).isnan().tolist() == [True, True]
        assert rewards.event_metrics() == {"reward_timeouts/dies": 0.0, "reward_failures/dies": 2.0}
    finally:
        rewards.close()
    strict = _rewards("dies", workers=1, sandbox="none", on_timeout="error")
    try:
        with pytest.raises(UserError, match=r"dies \(.*\) failed: its worker was killed by SIGKILL \(a memory limit"):
            _score(strict, ["a"])
    finally:
        strict.close()


def test_bad_reward_keys_are_named_with_their_fix():
    with pytest.raises(UserError) as e:
        reward_entries(
            [
                {"function": "m:f", "timeout": 5},
                {"function": "m:f", "timeout_s": -1, "on_timeout": "later", "sandbox": "docker"},
                {"builtin": "sympy"},
                {"function": "m:f", "builtin": "math_verify"},
                {"model": "dir", "timeout_s": 5},
            ]
        )
    assert str(e.value).splitlines()[1:] == [
        "  - rewards[0].timeout: is not a key of a reward. Did you mean timeout_s? A reward's keys: function, model, "
        "builtin, weight, timeout_s, on_timeout, sandbox.",
        "  - rewards[1].timeout_s: is -1. Use the seconds a call may take, above 0 (default 60).",
        "  - rewards[1].on_timeout: is 'later'. Use none (a call past its deadline is no opinion, counted in "
        "reward_timeouts/<name>) or error (the run stops).",
        "  - rewards[1].sandbox: is 'docker'. Use bwrap (bubblewrap: no network, a read-only file system, a private "
        "/tmp) or none.",
        "  - rewards[2].builtin: is 'sympy', not a built-in reward. Use one of: math_verify, code_tests.",
        "  - rewards[3]: needs exactly one of function, model and builtin (it has function, builtin). e.g. "
        '{function: "my_rewards:exact", weight: 1.0}, {builtin: math_verify} or {model: DIR}',
        "  - rewards[4].timeout_s: is set, but a reward model runs in the training process, in one batch per step. "
        "Remove timeout_s from this entry; it applies to a function or a builtin.",
    ]
    assert reward_entries([{"builtin": "code_tests", "weight": 2, "timeout_s": 30, "sandbox": "none"}]) == [
        RewardEntry("builtin", "code_tests", 2.0, 30.0, "none", "none")
    ]


def test_a_deadline_needs_workers(monkeypatch):
    entries = reward_entries([{"function": "m:f", "timeout_s": 5, "sandbox": "bwrap"}])
    assert [str(p) for p in reward_problems(entries, 0)] == [
        "rewards[0].timeout_s: is set, but rl.reward_workers is 0: a call in the training process cannot be "
        "stopped. Set rl.reward_workers to 1 or more (each call then has a deadline), or remove timeout_s.",
        "rewards[0].sandbox: is bwrap, but rl.reward_workers is 0: a function in the training process runs "
        "unconfined. Set rl.reward_workers to 1 or more (each worker then runs in the sandbox), or sandbox: none.",
    ]
    monkeypatch.setattr("llmft.scoring.probe.bwrap_problem", lambda: "bwrap is not installed (not on PATH)")
    assert [str(p) for p in reward_problems(entries, 2)] == [
        "rewards[0].sandbox: m:f runs its worker in a bubblewrap sandbox, but bwrap is not installed (not on PATH). "
        "Install bubblewrap (`apt-get install bubblewrap`; it needs unprivileged user namespaces, or root), or set "
        "rewards[0].sandbox: none to run it unconfined."
    ]
    assert reward_problems(reward_entries([{"function": "m:f"}]), 2) == []  # unset: unconfined where none works


@pytest.mark.timeout(120)  # a hung reward would hold the step forever
def test_a_grpo_step_goes_on_past_a_reward_that_hangs(tmp_path):
    rewards = [
        {"function": "grpo_rewards:per_char", "weight": 1.0},
        {"function": "pool_rewards:hangs_on_x", "weight": 1.0, "timeout_s": 1},
    ]
    assert train_inproc(grpo_recipe(tmp_path, rewards=rewards), "train.max_steps=1") == 0
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1]
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    answers = [json.loads(line)["answer"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    for step, row in enumerate(rows):  # each step: 2 prompts x G 4, the fourth completion of each ends in x
        assert row["reward_timeouts/hangs_on_x"] == 2.0 and row["reward_failures/hangs_on_x"] == 0.0
        assert row["reward_timeouts/per_char"] == 0.0
        known = [float(c == answers[q]) for q in (2 * step, 2 * step + 1) for c in lines[q]["completions"][:3]]
        assert row["rewards/hangs_on_x"] == pytest.approx(sum(known) / 6)  # the late calls left out


def test_a_worker_sandbox_keeps_llmft_and_the_interpreter_under_tmp_visible(tmp_path, monkeypatch):
    """The private /tmp hides what lies under /tmp: an editable llmft there (found by its install's
    finder, not through sys.path) and a venv there are bound back read-only, else the worker cannot
    start (``No module named 'llmft'``) and code tests cannot run at all."""
    import llmft.scoring.sandbox as sandbox

    package = tmp_path / "clone" / "llmft"
    package.mkdir(parents=True)
    monkeypatch.setattr(sandbox, "LLMFT_DIR", str(package))
    venv = tmp_path / "venv"
    venv.mkdir()
    monkeypatch.setattr(sandbox, "_interpreter_dirs", lambda: [str(venv)])
    argv = sandbox.bwrap_argv("worker", "/", ())
    tmpfs = argv.index("/tmp", argv.index("--tmpfs"))
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind" and i > tmpfs]
    assert str(package) in binds and str(venv) in binds
    strict = sandbox.bwrap_argv("strict")
    assert str(venv) in [strict[i + 1] for i, a in enumerate(strict) if a == "--ro-bind"]
