"""DataLoader workers that leave the stop signals to the training process (docs/design.md G3, docs/multinode.md).

A scheduler stops a job by signalling its whole process group: the launcher, every rank and
every DataLoader worker get SIGTERM (SLURM's warning: SIGUSR1/2; Ctrl-C: SIGINT to the
terminal's foreground group). The training process turns these into a stop request
(``llmft.stop``) and finishes the step; a worker must not die of them, or the training process
fails inside that step (``DataLoader worker (pid ...) is killed by signal: Terminated``) and no
checkpoint is written. So workers ignore them:

- ``ignore_stop_signals`` is the workers' ``worker_init_fn``. torch installs its own SIGTERM
  handler in each worker (it exits quietly when the parent sends SIGTERM and re-raises it
  otherwise) before it calls ``worker_init_fn``, so the handler is overridden there.
- Between the fork and that call a worker still has torch's handler (or the default one). The
  window is closed by forking the workers with the stop signals blocked
  (``StopSafeDataLoader._get_iterator``): a worker is born with them blocked, sets them to
  ignored (which discards any that arrived meanwhile) and only then unblocks them; the training
  process unblocks them right after the fork and handles any that arrived meanwhile.

Workers still end with their parent: torch's shutdown tells them to exit, and a worker whose
parent died exits on its own (torch's watchdog). One exit path needed help: torch leaves
workers that are still running at interpreter exit to ``multiprocessing``, which sends them
SIGTERM (now ignored) and then waits for them forever. ``_shut_down_at_exit`` shuts them down
first, the way torch does for an iterator that is deleted, and SIGKILLs any that linger.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import weakref
from typing import Iterator

import torch

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"))


def ignore_stop_signals(worker_id: int = 0) -> None:
    """``worker_init_fn``: this worker ignores the stop signals, then unblocks them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold the stop signals back in this thread (and in processes it forks) for the block."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # pending ones are delivered now


class StopSafeDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose workers are forked with the stop signals blocked (see the module doc)."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        with stop_signals_blocked():
            iterator = super()._get_iterator()  # starts the worker processes
        _live_iterators.add(iterator)
        return iterator


_live_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register  # registered after torch's exit flag, so it runs before it (and before multiprocessing's)
def _shut_down_at_exit() -> None:
    for iterator in list(_live_iterators):
        iterator._shutdown_workers()  # what torch does when an iterator is deleted: workers exit cleanly
        for worker in getattr(iterator, "_workers", []):
            if worker.is_alive():  # stuck: SIGTERM is ignored, SIGKILL is not
                worker.kill()
                worker.join(timeout=5)
