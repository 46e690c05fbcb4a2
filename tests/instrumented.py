"""``llmft`` with test instrumentation: ``python tests/instrumented.py COMMAND ...`` (also under torchrun).

Installs ``llmft.training.run.RunHooks`` from two environment variables of the tests (production code
reads neither), then runs the normal command line:

- ``LLMFT_SAMPLE_LOG=DIR``: each rank appends the dataset indices of every micro-batch it takes
  to ``DIR/rank-<R>.jsonl``, which proves that a resume neither skips nor repeats a sample;
- ``LLMFT_FAULT_INJECT=kill_in_save:<step>[:<rank>]``: SIGKILL this process (or only that rank)
  after it wrote its part of checkpoint ``step``, before the checkpoint is committed;
- ``LLMFT_FAULT_INJECT=sleep_in_collective:<step>:<rank>``: that rank sleeps (an hour) where it
  would all-reduce the loss of optimizer step ``step``: a rank stuck inside a collective.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the repo's llmft, as `-m llmft` from ROOT would

SAMPLE_LOG = "LLMFT_SAMPLE_LOG"
FAULT = "LLMFT_FAULT_INJECT"


class SampleLog:
    """A batch sampler that also appends each micro-batch's dataset indices to a file."""

    def __init__(self, sampler, directory: str, env, first_step: int) -> None:
        self.sampler = sampler
        self.path = Path(directory) / f"rank-{env.rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_size = env.world_size
        self.first_step = first_step

    def __iter__(self):
        accumulation = self.sampler.plan.gradient_accumulation_steps
        for i, indices in enumerate(self.sampler):
            row = {
                "step": self.first_step + i // accumulation + 1,
                "micro_step": i % accumulation,
                "world_size": self.world_size,
                "indices": [int(j) for j in indices],
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            yield indices

    def __len__(self) -> int:
        return len(self.sampler)


def hooks():
    from llmft.training.run import RunHooks

    log_dir = os.environ.get(SAMPLE_LOG)
    kind, _, where = os.environ.get(FAULT, "").partition(":")
    at, _, only_rank = where.partition(":")

    def wrap_sampler(sampler, first_step, env):
        return SampleLog(sampler, log_dir, env, first_step) if log_dir else sampler

    def before_commit(step: int, rank: int) -> None:
        if kind == "kill_in_save" and at == str(step) and only_rank in ("", str(rank)):
            os.kill(os.getpid(), signal.SIGKILL)

    if kind == "sleep_in_collective":
        _sleep_in_collective(int(at), int(only_rank))
    return RunHooks(wrap_sampler=wrap_sampler, before_commit=before_commit)


def _sleep_in_collective(step: int, rank: int) -> None:
    import time

    import llmft.training.loop
    from llmft.job import watchdog
    from llmft.job.dist import read_env

    real = llmft.training.loop.all_reduce_sum

    def all_reduce_sum(values, device):
        w = watchdog.active()
        if read_env().rank == rank and w is not None and w.step == step and "loss" in w.phase:
            with watchdog.collective("all_reduce"):
                time.sleep(3600)
        return real(values, device)

    llmft.training.loop.all_reduce_sum = all_reduce_sum


if __name__ == "__main__":
    from llmft.cli import main
    from llmft.training.run import install_hooks

    install_hooks(hooks())
    sys.exit(main(sys.argv[1:]))
