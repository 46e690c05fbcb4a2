"""Stop requests: SIGTERM, SLURM's warning signal (SIGUSR1/2) and Ctrl-C.

The handler only sets a flag; the loop all-reduces it at the next step boundary
so every rank stops after the same optimizer step, checkpoints, and exits with
``STOPPED_EXIT_CODE``. A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("llmft")

STOPPED_EXIT_CODE = 75  # "try again later" (EX_TEMPFAIL): stopped on request, checkpoint written


class StopRequest:
    def __init__(self, extra_signal: str = "SIGUSR1") -> None:
        self.requested: str | None = None
        self._sigint_count = 0
        self._previous: dict[int, object] = {}
        self._signals = [signal.SIGTERM, signal.SIGINT, getattr(signal, extra_signal)]

    def install(self) -> StopRequest:
        for sig in self._signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners)
                pass
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                raise KeyboardInterrupt  # the second Ctrl-C aborts without a checkpoint
        if self.requested is None:
            log.warning("%s received: finishing this optimizer step, then checkpointing and exiting", name)
        self.requested = self.requested or name
