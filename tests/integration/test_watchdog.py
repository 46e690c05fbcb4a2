"""The stall watchdog (llmft.job.watchdog) in a process of its own: it ends a rank that makes no progress
for ``distributed.timeout_s`` with its step, phase, collective and every thread's stack (exit 124),
and leaves alone a rank that is busy in eval or a checkpoint (their collectives are timed instead).
The multi-rank cases (a rank asleep in a collective, a rank frozen by SIGSTOP) are
tests/distributed/test_hangs.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

STALL = textwrap.dedent(
    """
    import time
    from llmft.job import watchdog

    def wait_for_the_peer():
        with watchdog.collective("all_reduce"):
            time.sleep(60)

    w = watchdog.start(timeout_s=1, rank=0)
    watchdog.progress(3, "forward and backward of micro-batch 1 of 2")
    wait_for_the_peer()
    """
)

BUSY = textwrap.dedent(
    """
    import time
    from llmft.job import watchdog

    w = watchdog.start(timeout_s=1, rank=0)
    watchdog.progress(2, "the optimizer step")
    with watchdog.idle("the checkpoint"):
        time.sleep(3)  # three timeouts, not timed
    watchdog.progress(3, "fetching and counting the micro-batches")
    w.stop()
    print("done")
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    # The timeout is the hang guard only: a watchdog that never fires would leave the sleep running.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT)


def test_a_stalled_rank_reports_where_it_was_and_exits_124():
    done = _run(STALL)
    assert done.returncode == 124, done.stderr
    assert "rank 0: no progress for " in done.stderr
    assert (
        "s (distributed.timeout_s is 1); it was in forward and backward of micro-batch 1 of 2 (step 3), "
        "in the collective all_reduce." in done.stderr
    )
    # faulthandler's stacks: the stuck main thread in the function that waits, and the watchdog's own.
    assert "line 7 in wait_for_the_peer" in done.stderr
    assert "in _watch" in done.stderr and done.stderr.count("(most recent call first)") >= 2


def test_eval_and_checkpoints_are_not_timed_by_the_watchdog():
    done = _run(BUSY)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n" and "no progress" not in done.stderr


SPIN = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    from llmft.job.dist import leave_process

    t = torch.randn(200_000)

    def spin():  # a library's thread, inside a torch operator most of the time
        while True:
            t.mul_(1.0000001)

    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.2)
    if sys.argv[1] == "leave":
        leave_process(0)
    """
)


def test_a_thread_inside_torch_aborts_teardown_and_leave_process_avoids_it():
    """The cause of the SIGABRT after finished multi-rank runs (docs/reliability.md#what-hung-and-what-aborted):
    interpreter finalization ends a thread that is inside a torch operator through a noexcept frame."""

    def run(how: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SPIN, how], capture_output=True, text=True, timeout=60, cwd=ROOT)

    tries = []
    for _ in range(3):  # it aborts on the first try here (20 of 20); more tries only against an unlucky moment
        tries.append(run("teardown"))
        if tries[-1].returncode == -6:
            break
    assert tries[-1].returncode == -6, [(d.returncode, d.stderr[-300:]) for d in tries]
    assert "terminate called without an active exception" in tries[-1].stderr
    left = run("leave")
    assert left.returncode == 0, left.stderr
