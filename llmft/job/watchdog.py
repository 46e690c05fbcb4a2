"""No wait without bound in a multi-rank run: the stall watchdog and the report of a rank that gives up.

Two things end a rank that waits for another (``distributed.timeout_s``, docs/reliability.md):

- a collective that times out (the process group's timeout) or fails because a peer left raises;
  ``llmft train`` hands the error to ``give_up``;
- the watchdog, a thread, sees no progress of the training loop for ``timeout_s`` (no micro-step
  started or finished): a rank whose peer is frozen (SIGSTOP, a wedged driver) before the
  collective, or a rank stuck anywhere else in the step. Eval and checkpoint saves are not timed
  by it (``idle``); their collectives are, by the process group's timeout.

Either way the rank logs what it was doing (the phase and the collective it was in, the step), a
Python stack of every thread (``faulthandler``), and exits with ``TIMEOUT_EXIT_CODE`` at once
(``os._exit``: the interpreter's teardown would wait for the peer again). The launcher then ends
the other ranks. Standard library only: the loop, the collectives and ``llmft train`` mark where
they are through the module functions, which cost nothing when no watchdog runs (one process).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

log = logging.getLogger("llmft")

TIMEOUT_EXIT_CODE = 124  # what timeout(1) returns: the job waited too long
REPORT_S = 30.0  # the longest the report of a rank that gives up may take

_active: Watchdog | None = None
_collective: list[str] = []  # the collective the main thread is in (the watchdog thread reads it)
_failed: list[str] = []  # the collective that raised, for the report that follows
_gave_up = threading.Lock()


class Watchdog:
    """A daemon thread that ends this rank when the training loop makes no progress for ``timeout_s``."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.step = 0
        self.phase = "setting up the run"
        self.armed = False  # the first progress() arms it: loading and setup are not timed here
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llmft-watchdog", daemon=True)

    def start(self) -> Watchdog:
        global _active
        _active = self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the thread (no thread of ours is left for the interpreter's teardown)."""
        global _active
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if _active is self:
            _active = None

    def progress(self, step: int, phase: str) -> None:
        self.step, self.phase, self.last, self.armed = step, phase, time.monotonic(), True

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            waited = time.monotonic() - self.last
            if self.armed and waited > self.timeout_s:
                give_up(f"no progress for {waited:.0f} s (distributed.timeout_s is {self.timeout_s:g})")


def start(timeout_s: float, rank: int) -> Watchdog:
    return Watchdog(timeout_s, rank).start()


def active() -> Watchdog | None:
    return _active


def progress(step: int, phase: str) -> None:
    """The loop moved on: ``phase`` of optimizer step ``step`` begins (resets the stall clock)."""
    if _active is not None:
        _active.progress(step, phase)


def phase(name: str) -> None:
    """The current step moved on to ``name`` (an objective's data stage: generation, scoring)."""
    if _active is not None:
        _active.progress(_active.step, name)


@contextlib.contextmanager
def idle(phase: str) -> Iterator[None]:
    """Not timed by the watchdog inside the block (eval, checkpoint, the end of the run); a failing
    collective in it still names ``phase``."""
    w = _active
    if w is None:
        yield
        return
    before = (w.phase, w.armed)
    w.phase, w.armed = phase, False
    try:
        yield
    finally:
        w.phase, w.armed, w.last = before[0], before[1], time.monotonic()


@contextlib.contextmanager
def collective(name: str) -> Iterator[None]:
    """Name the collective this rank is in, for the report if it never returns."""
    _collective.append(name)
    try:
        yield
    except BaseException:
        _failed[:] = [name]
        raise
    finally:
        _collective.pop()


def where() -> str:
    """'PHASE (step N), in the collective NAME': what this rank was doing."""
    w = _active
    step, phase = (w.step, w.phase) if w is not None else (None, "outside the training loop")
    text = phase if step is None else f"{phase} (step {step})"
    name = _collective[-1] if _collective else (_failed[-1] if _failed else None)
    return f"{text}, in the collective {name}" if name else text


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(TIMEOUT_EXIT_CODE)


def give_up(reason: str) -> NoReturn:
    """Log ``reason``, where this rank was and every thread's stack; exit ``TIMEOUT_EXIT_CODE`` now."""
    _gave_up.acquire()  # the first caller reports; a second (the other path, same moment) waits for the exit
    # The report itself must not hang the rank (a stderr pipe nobody reads, a logging lock held by the
    # stuck thread): whatever happens to it, the rank exits within REPORT_S.
    threading.Thread(target=_exit_after, args=(REPORT_S,), name="llmft-exit", daemon=True).start()
    rank = _active.rank if _active is not None else int(os.environ.get("RANK", "0"))
    log.error(
        "rank %d: %s; it was in %s. The Python stack of every thread of this rank follows; exiting with %d "
        "(docs/reliability.md#a-rank-that-waits-too-long)",
        rank,
        reason,
        where(),
        TIMEOUT_EXIT_CODE,
    )
    for handler in log.handlers:
        handler.flush()
    sys.stderr.flush()
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured in-process)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os._exit(TIMEOUT_EXIT_CODE)
