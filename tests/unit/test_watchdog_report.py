"""What a rank that gives up says about where it was (llmft.job.watchdog.where) and which errors count as
a failed collective (llmft.job.dist.is_comm_failure). The exits themselves: tests/integration/test_watchdog.py
and tests/distributed/test_hangs.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from llmft.job import watchdog
from llmft.job.dist import is_comm_failure


def test_where_names_phase_step_and_the_collective_that_failed():
    w = watchdog.Watchdog(timeout_s=60, rank=1)  # not started: no thread
    watchdog._active = w
    try:
        assert watchdog.where() == "setting up the run (step 0)"
        watchdog.progress(4, "the optimizer step")
        with watchdog.collective("barrier"):
            assert watchdog.where() == "the optimizer step (step 4), in the collective barrier"
        with pytest.raises(RuntimeError), watchdog.idle("the checkpoint"), watchdog.collective("all_reduce"):
            raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
        # after the failure the report still names the collective it came from
        assert watchdog.where() == "the optimizer step (step 4), in the collective all_reduce"
        assert w.armed  # idle() gave the timing back
    finally:
        watchdog._active = None
        watchdog._failed.clear()


@pytest.mark.parametrize(
    "error, expected",
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5864"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (dist.DistBackendError("NCCL watchdog: collective timed out"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Timed out waiting"), False),
    ],
)
def test_comm_failures_are_gloo_and_nccl_collective_errors_only(error, expected):
    assert is_comm_failure(error) is expected
