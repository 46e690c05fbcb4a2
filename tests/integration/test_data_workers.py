"""DataLoader workers ignore the stop signals; the training process owns them (docs/design.md G3)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llmft.data import make_loader
from llmft.data.workers import STOP_SIGNALS, stop_signals_blocked


class _Rows:
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "position_ids": None, "pid": os.getpid()}


def _pid_collate(rows):
    return rows[0]["pid"]


def test_a_data_worker_survives_every_stop_signal():
    sampler = [[i] for i in range(1000)]
    dl = make_loader(_Rows(), sampler, pad_id=0, num_workers=1, prefetch_factor=2)
    dl.collate_fn = _pid_collate  # yields the pid of the worker that built the batch
    it = iter(dl)
    worker = next(it)
    assert worker != os.getpid()  # built in a worker process
    for sig in STOP_SIGNALS:
        os.kill(worker, sig)
    time.sleep(0.5)
    assert next(it) == worker  # the same worker, alive, still serving
    del it


def test_workers_are_forked_with_the_stop_signals_blocked_and_the_parent_gets_them_after():
    """A process forked inside the block starts with the stop signals blocked (so no signal can kill
    a worker before it ignores them); in the parent a signal is not lost: it is handled, at the
    latest when the block ends. (Another thread of the process may take it earlier: blocking is
    per thread, and the training process's handler only sets its stop flag.)"""
    got = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
    try:
        with stop_signals_blocked():
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report its signal mask, exit at once
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
                os.write(write, b"ok" if set(STOP_SIGNALS) <= blocked else b"unblocked")
                os._exit(0)
            os.close(write)
            child = os.read(read, 16)
            os.close(read)
            os.waitpid(pid, 0)
            os.kill(os.getpid(), signal.SIGUSR2)
        assert child == b"ok"
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:  # Python runs handlers between bytecodes
            time.sleep(0.01)
        assert got == [signal.SIGUSR2]  # delivered once, not lost
        assert not set(STOP_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the mask is restored
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_yields_the_same_batches_with_and_without_workers(num_workers):
    from llmft.data.loader import collate

    rows = [{"input_ids": [i, i + 1], "labels": [i, i + 1], "position_ids": None} for i in range(8)]
    dl = make_loader(rows, [[0, 1], [2, 3], [4, 5]], pad_id=0, num_workers=num_workers, prefetch_factor=2)
    got = [b["input_ids"].tolist() for b in dl]
    assert got == [collate([rows[a], rows[b]], 0)["input_ids"].tolist() for a, b in [[0, 1], [2, 3], [4, 5]]]


def test_workers_still_running_at_exit_do_not_hang_it(tmp_path):
    """A worker ignores the SIGTERM that multiprocessing sends daemonic children at exit; the
    process must still exit (here with the iterator kept alive to the end, as a traceback may)."""
    import subprocess
    import sys

    script = tmp_path / "keep.py"
    script.write_text(
        "from llmft.data import make_loader\n"
        "rows = [{'input_ids': [1, 2], 'labels': [1, 2], 'position_ids': None}] * 100\n"
        "KEEP = iter(make_loader(rows, [[i] for i in range(100)], 0, 1, 2))\n"
        "next(KEEP)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
