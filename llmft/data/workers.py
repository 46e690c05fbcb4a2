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
first, the way torch does for an iterator that is deleted, and SIGKILLs any that linger. A
loader whose start fails after its workers were forked (torch then never returns the iterator)
ends those workers at once, before the error travels on (``StopSafeDataLoader._get_iterator``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import signal
import weakref
from types import TracebackType
from typing import Iterator

import torch

log = logging.getLogger("llmft")

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
        before = set(multiprocessing.active_children())
        try:
            with stop_signals_blocked():
                iterator = super()._get_iterator()  # starts the worker processes, then asks for batches
        except BaseException as e:
            # Torch never hands the iterator back (its sampler raised once the workers ran, e.g. a
            # bad resume position), and the error's traceback keeps it alive: nothing would tell its
            # workers to exit, and interpreter exit would wait for them forever. It is shut down
            # here as torch does for a deleted one (which also stops watching its workers' exits).
            for half_made in _iterators_in(e.__traceback__):
                half_made._shutdown_workers()
            _end([p for p in multiprocessing.active_children() if p not in before])
            raise
        _live_iterators.add(iterator)
        return iterator


_live_iterators: weakref.WeakSet = weakref.WeakSet()


def _iterators_in(tb: TracebackType | None) -> list:
    """The DataLoader iterators whose methods a traceback passes through (``self`` of each frame)."""
    found = []
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, torch.utils.data.dataloader._MultiProcessingDataLoaderIter) and me not in found:
            found.append(me)
        tb = tb.tb_next
    return found


def _end(workers: list) -> None:
    """SIGKILL workers that did not exit when told to (they ignore SIGTERM); wait a bounded time."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)
            if worker.is_alive():
                log.warning(
                    "DataLoader worker pid %s did not end within 5 s of SIGKILL; not waiting for it", worker.pid
                )


@atexit.register  # registered after torch's exit flag, so it runs before it (and before multiprocessing's)
def _shut_down_at_exit() -> None:
    for iterator in list(_live_iterators):
        iterator._shutdown_workers()  # what torch does when an iterator is deleted: workers exit cleanly
        _end(getattr(iterator, "_workers", []))  # stuck: SIGTERM is ignored, SIGKILL is not
