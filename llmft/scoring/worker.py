"""A reward worker: ``python -m llmft.scoring.worker``, started by ``llmft.scoring.pool``.

It reads its setup, then one call after another, on stdin (a 4-byte length and a JSON document, written
by the trainer that started it: a record's fields that JSON has no type for arrive as their ``str``) and answers each with one JSON line on the stdout it had at start; the
reward's own prints go to stderr. It imports the function by ``module:name`` (or builds a built-in
reward) once, with the trainer's ``sys.path``, and calls it on its main thread (math-verify's own
timeout is a signal, which Python delivers only there).

Replies (the trainer formats them into the messages an in-process call gives): ``{"ready": true}``
or ``{"error": ...}`` once; then per call ``{"value": float | null}``, ``{"bad": repr}`` (not a
finite float, None, or a bool) or ``{"raised": type name, "message": ...}``. After each call the
processes the reward started and left behind are killed.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import struct
import sys
from typing import Any, BinaryIO, Callable

from llmft.limits import REWARD_REPR_CHARS
from llmft.scoring.builtin_rewards import make_builtin
from llmft.scoring.sandbox import descendants


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed stdin ends the worker instead
        pass


def read_message(f: BinaryIO) -> Any:
    """One message (None at the end of the stream)."""
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    body = f.read(n)
    if len(body) < n:
        return None
    return json.loads(body)  # from the trainer that started this process


def encode_message(message: Any) -> bytes:
    body = json.dumps(message, default=str, ensure_ascii=False).encode()
    return struct.pack(">I", len(body)) + body


def _load(target: dict[str, Any]) -> Callable[..., Any]:
    if "builtin" in target:
        return make_builtin(target["builtin"], **target.get("options", {}))
    module_name, _, name = target["function"].partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise LookupError(f"cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise LookupError(f"module {module_name!r} has no function {name!r}")
    return fn


def finite_reward(value: Any) -> bool:
    """Whether a reward's value is one the trainer takes: a finite int or float (not a bool; None,
    no opinion, is judged apart). In a worker and in the training process alike."""
    try:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except (OverflowError, ValueError):  # an int beyond float's range
        return False


def _reply(value: Any) -> dict[str, Any]:
    """What the trainer accepts from a reward, as in-process ``Rewards._call`` judges it."""
    if value is None:
        return {"value": None}
    if finite_reward(value):
        return {"value": float(value)}
    return {"bad": shown_value(value)}


def shown_value(value: Any) -> str:
    """A wrong value as a message shows it: its repr, cut to ``REWARD_REPR_CHARS``."""
    shown = repr(value)
    return shown if len(shown) <= REWARD_REPR_CHARS else shown[:REWARD_REPR_CHARS] + "..."


def _children() -> list[int]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def _kill_leftovers() -> None:
    """Kill what the call started and left running (and reap it): the reward returned, its processes
    have no business writing or computing on. (A process that detached from this one before the call
    ended is in its sandbox, and dies when the worker is killed or closed.)"""
    if not _children():
        return
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    _die_with_parent()
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # print() of a reward goes to stderr, never into the replies

    def send(reply: dict[str, Any]) -> None:
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()

    setup = read_message(inp)
    if setup is None:
        return
    sys.path[:0] = [p for p in setup["sys_path"] if p not in sys.path]
    try:
        fn = _load(setup["target"])
    except Exception as e:
        send({"error": str(e) if isinstance(e, LookupError) else f"{type(e).__name__}: {e}"})
        return
    send({"ready": True})
    while (call := read_message(inp)) is not None:
        try:
            reply = _reply(fn(**call))
        except BaseException as e:  # SystemExit too: the call failed, the worker stays
            reply = {"raised": type(e).__name__, "message": str(e)[:4000]}
        _kill_leftovers()
        send(reply)


if __name__ == "__main__":
    main()
