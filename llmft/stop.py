"""Stop requests: SIGTERM, SLURM's warning signal (SIGUSR1/2) and Ctrl-C.

The handler only sets a flag (and logs one line); what happens next depends on what the process
is doing, which it names with ``StopRequest.during``:

- training (the default): the loop all-reduces the flag at the next step boundary so every rank
  stops after the same optimizer step, checkpoints, and exits with ``STOPPED_EXIT_CODE``;
- preparing data (``during(BUILDING)``): the cache build calls ``check()`` every 0.2 s while
  its workers tokenize (in one process: every batch of 256 records), which raises ``Stopped``;
  the tokenized shards it finished are kept for the next build, and the command exits
  ``STOPPED_EXIT_CODE`` with no checkpoint (nothing was trained yet).

A second Ctrl-C aborts at once. The handler is in the process that installed it only: worker
processes the build forks ignore these signals, so one stop is one log line.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

log = logging.getLogger("llmft")

STOPPED_EXIT_CODE = 75  # "try again later" (EX_TEMPFAIL): stopped on request, checkpoint written

TRAINING = "finishing this optimizer step, then checkpointing and exiting"
BUILDING = "stopping the data build; its finished shards are kept, and the same command continues from them"

_active: StopRequest | None = None  # the installed request of this process, if any


class Stopped(Exception):
    """Raised where a stop request ends a command before training started (exit ``STOPPED_EXIT_CODE``).

    The handler already logged the one line a stop gets; the CLI prints nothing more."""

    exit_code = STOPPED_EXIT_CODE


class StopRequest:
    def __init__(self, extra_signal: str = "SIGUSR1") -> None:
        self.requested: str | None = None
        self.action = TRAINING  # what the one log line says happens next
        self.said: str | None = None  # the action the log line said, once a stop arrived
        self._sigint_count = 0
        self._previous: dict[int, object] = {}
        self._signals = [signal.SIGTERM, signal.SIGINT, getattr(signal, extra_signal)]

    def install(self) -> StopRequest:
        global _active
        for sig in self._signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners)
                pass
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if _active is self:
            _active = None

    @contextlib.contextmanager
    def during(self, action: str) -> Iterator[StopRequest]:
        """Say ``action`` (instead of the training one) for a stop that arrives inside the block."""
        before, self.action = self.action, action
        try:
            yield self
        finally:
            self.action = before

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                raise KeyboardInterrupt  # the second Ctrl-C aborts without a checkpoint
        if self.requested is None:
            log.warning("%s received: %s", name, self.action)
            self.said = self.action
        self.requested = self.requested or name


def active() -> StopRequest | None:
    """The stop request installed in this process (``llmft train``, ``llmft prepare``), if any."""
    return _active


def requested() -> str | None:
    """The signal that asked this process to stop, if one did (and a request is installed)."""
    return _active.requested if _active is not None else None


def check(action: str = BUILDING) -> None:
    """Raise ``Stopped`` if a stop was requested. A request that came before ``action`` began (its
    log line promised a checkpoint after a step) gets one more line, saying what happens instead."""
    r = _active
    if r is None or r.requested is None:
        return
    if r.said != action:
        log.warning("%s received earlier: %s", r.requested, action)
        r.said = action
    raise Stopped


@contextlib.contextmanager
def during(action: str) -> Iterator[None]:
    """``StopRequest.during`` on the installed request; nothing when none is installed."""
    if _active is None:
        yield
        return
    with _active.during(action):
        yield
