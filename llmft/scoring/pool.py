"""A pool of reward worker processes with a deadline per call (``rl.reward_workers``, ``rewards[].timeout_s``).

One pool serves one entry of ``rewards`` (a function or a built-in): ``size`` workers (``python -m
llmft.scoring.worker``), each in a bubblewrap sandbox (``sandbox.bwrap_argv("worker")``) or in its
own session and temporary directory (``sandbox: none``). ``run`` gives a column's calls to the
workers as they free up and yields each call's ``Outcome`` as it comes; a call that has not answered
``timeout_s`` after it was sent is a ``timeout``: its worker is killed with everything it started
(``sandbox.kill_tree``) and a fresh one takes its place. A worker that dies in a call (a memory
limit, a crash, ``os._exit``) is a ``died`` outcome and is replaced the same way. A worker's start
(the interpreter, the sandbox, importing the module) counts in no call's deadline; one that cannot
start is a ``WorkerStartError`` (its own message: the import error, or how it died).

The trainer reads only JSON from its workers, never a pickle: what runs there cannot make the
trainer execute anything.
"""

from __future__ import annotations

import collections
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmft.limits import REWARD_REPLY_MAX_BYTES, REWARD_WORKER_START_S
from llmft.scoring.sandbox import LLMFT_DIR, bwrap_argv, kill_tree
from llmft.scoring.worker import encode_message

POLL_S = 0.2  # the longest the pool waits before looking at a stop request again
_LLMFT_ROOT = str(Path(LLMFT_DIR).parent)  # where ``import llmft`` finds this llmft


class WorkerStartError(Exception):
    """A worker could not import its reward, or died or hung before it was ready."""


@dataclass(frozen=True)
class Outcome:
    """What became of call ``index``: ``value`` (a float, or None: no opinion), ``bad`` (``text``: the
    repr of what it returned), ``raised`` (``text``: ``Type: message``), ``timeout``, or ``died``
    (``text``: how)."""

    index: int
    kind: str
    value: float | None = None
    text: str = ""


class _Worker:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, setup: bytes, tmpdir: str | None) -> None:
        self.tmpdir = tmpdir
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True
        )
        self.fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.send_bytes(setup)

    def send_bytes(self, data: bytes) -> bool:
        try:
            self.proc.stdin.write(data)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            return True
        except (BrokenPipeError, OSError):
            return False

    def replies(self) -> list[dict[str, Any]] | None:
        """The complete replies that arrived (after select said readable); None: it is gone or broken."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError:
            return None
        if not chunk:
            return None
        self.buf += chunk
        if len(self.buf) > REWARD_REPLY_MAX_BYTES:
            return None
        *lines, self.buf = self.buf.split(b"\n")
        try:
            out = [json.loads(line) for line in lines]
        except ValueError:
            return None
        return out if all(isinstance(m, dict) for m in out) else None

    def death(self) -> str:
        """How it ended, once it has (killed by a signal, an exit status, or a broken reply)."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it wrote a reply that is not one JSON line per call"
        if code < 0:
            name = signal.Signals(-code).name
            why = {
                "SIGKILL": " (a memory limit, or the kernel's out-of-memory killer)",
                "SIGXCPU": " (its CPU time limit)",
                "SIGXFSZ": " (its file size limit)",
            }.get(name, "")
            return f"its worker was killed by {name}{why}"
        return f"its worker exited with status {code}"

    def kill(self) -> None:
        kill_tree(self.proc)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def _kill_all(workers: list[_Worker | None]) -> None:
    for w in workers:
        if w is not None:
            w.kill()
    workers[:] = [None] * len(workers)


class WorkerPool:
    """``size`` workers of one reward (module docstring). ``target``: ``{"function": "module:name"}`` or
    ``{"builtin": name, "options": {...}}``; ``sandboxed``: in bubblewrap (else its own session and
    temporary directory, unconfined)."""

    def __init__(self, target: dict[str, Any], size: int, timeout_s: float, sandboxed: bool) -> None:
        assert size >= 1
        self.target, self.timeout_s, self.sandboxed = target, timeout_s, sandboxed
        self._slots: list[_Worker | None] = [None] * size
        self._finalizer = weakref.finalize(self, _kill_all, self._slots)
        self._fill()  # start now: importing happens while the trainer builds the rest

    def _start(self) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_LLMFT_ROOT, env.get("PYTHONPATH")) if p)
        cwd, tmpdir = os.getcwd(), None
        cmd = [sys.executable, "-m", "llmft.scoring.worker"]
        if self.sandboxed:
            argv = [*bwrap_argv("worker", cwd, tuple(p or cwd for p in sys.path)), *cmd]
        else:
            tmpdir = tempfile.mkdtemp(prefix="llmft-reward-")
            env["TMPDIR"] = tmpdir
            argv = cmd
        path = [p or cwd for p in sys.path]  # "": the trainer's working directory
        setup = encode_message({"sys_path": path, "target": self.target})
        return _Worker(argv, env, cwd, setup, tmpdir)

    def _fill(self) -> None:
        for i, w in enumerate(self._slots):
            if w is None:
                self._slots[i] = self._start()

    def _drop(self, w: _Worker) -> None:
        w.kill()
        self._slots[self._slots.index(w)] = None

    def run(self, calls: list[dict[str, Any]], stopping: Callable[[], bool]) -> Iterator[Outcome]:
        """Each call's outcome, in the order they finish. Stops early (no more outcomes) once
        ``stopping()`` is true; closing the iterator early kills the workers still in a call."""
        pending = collections.deque(range(len(calls)))
        busy: dict[_Worker, tuple[int, float]] = {}
        try:
            while pending or busy:
                if stopping():
                    return
                if pending:
                    self._fill()
                for w in [w for w in self._slots if w is not None and w.ready and w not in busy]:
                    if not pending:
                        break
                    j = pending.popleft()
                    if w.send_bytes(encode_message(calls[j])):
                        busy[w] = (j, time.monotonic() + self.timeout_s)
                    else:  # it died between calls: the call goes to the next worker
                        pending.appendleft(j)
                        self._drop(w)
                live = [w for w in self._slots if w is not None and (w in busy or not w.ready)]
                if not live:
                    continue
                deadlines = [d for _, d in busy.values()]
                deadlines += [w.started + REWARD_WORKER_START_S for w in live if not w.ready]
                wait = min(max(min(deadlines) - time.monotonic(), 0.0), POLL_S)
                readable, _, _ = select.select([w.fd for w in live], [], [], wait)
                for w in [w for w in live if w.fd in readable]:
                    yield from self._read(w, busy)
                now = time.monotonic()
                for w, (j, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[w]
                        self._drop(w)
                        yield Outcome(j, "timeout")
                for w in live:
                    if not w.ready and w in self._slots and now >= w.started + REWARD_WORKER_START_S:
                        self._drop(w)
                        raise WorkerStartError(f"its worker did not start within {REWARD_WORKER_START_S:.0f} s")
        finally:
            for w in list(busy):  # an early end: these calls' answers are not wanted
                self._drop(w)

    def _read(self, w: _Worker, busy: dict[_Worker, tuple[int, float]]) -> Iterator[Outcome]:
        replies = w.replies()
        if replies is None:
            how = w.death()
            job = busy.pop(w, None)
            self._drop(w)
            if job is None:
                raise WorkerStartError(f"{how} before it was ready")
            yield Outcome(job[0], "died", text=how)
            return
        for m in replies:
            if not w.ready:
                if "error" in m:
                    self._drop(w)
                    raise WorkerStartError(str(m["error"]))
                w.ready = True
                continue
            job = busy.pop(w, None)
            if job is None:  # a reply nobody asked for: a broken worker
                self._drop(w)
                return
            j = job[0]
            if "value" in m and (m["value"] is None or isinstance(m["value"], float)):
                yield Outcome(j, "value", value=m["value"])
            elif "bad" in m:
                yield Outcome(j, "bad", text=str(m["bad"]))
            elif "raised" in m:
                yield Outcome(j, "raised", text=f"{m['raised']}: {m.get('message', '')}")
            else:
                self._drop(w)
                yield Outcome(j, "died", text="its worker wrote a reply llmft does not know")
                return

    def close(self) -> None:
        """Kill every worker (and what it started); the pool starts fresh ones if used again."""
        _kill_all(self._slots)
