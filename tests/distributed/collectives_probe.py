"""Run under torchrun: train 3 steps at accumulation 4 and record gradient reductions per micro-step.

Arguments: RECIPE ENGINE OUTPUT_DIR [KEY=VALUE ...] (extra overrides).

DDP: a comm hook counts bucket all-reduces. FSDP2: ``reduce_scatter_tensor`` is wrapped.
The loop's scalar all-reduces (token count, loss) are not gradient reductions and are not
counted. Prints one JSON line on rank 0: {"per_micro_step": [[boundary, reductions], ...]}.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from llmft.engines import ddp as ddp_engine
from llmft.engines import fsdp as fsdp_engine
from llmft.job.dist import leave_process
from llmft.training.train import train

COUNT = {"reductions": 0}
LOG: list[tuple[bool, int]] = []


def _count_ddp() -> None:
    original = ddp_engine.DDPEngine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)

        def hook(state, bucket):
            COUNT["reductions"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        self.model.register_comm_hook(None, hook)

    ddp_engine.DDPEngine.__init__ = init


def _count_fsdp() -> None:
    # FSDP2 reduce-scatters through reduce_scatter_single (torch >= 2.10) or reduce_scatter_tensor.
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            COUNT["reductions"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _record(engine_cls) -> None:
    """Snapshot the count around every micro-step's backward."""
    micro_step, backward = engine_cls.micro_step, engine_cls.backward
    state = {"boundary": False}

    def wrapped_micro_step(self, boundary):
        state["boundary"] = boundary
        return micro_step(self, boundary)

    def wrapped_backward(self, loss):
        before = COUNT["reductions"]
        backward(self, loss)
        LOG.append((state["boundary"], COUNT["reductions"] - before))

    engine_cls.micro_step, engine_cls.backward = wrapped_micro_step, wrapped_backward


def main() -> None:
    recipe, engine, out, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    if engine == "ddp":
        _count_ddp()
        _record(ddp_engine.DDPEngine)
    else:
        _count_fsdp()
        _record(fsdp_engine.FSDPEngine)
    rank = int(__import__("os").environ.get("RANK", "0"))
    code = train(
        recipe,
        [
            f"distributed.engine={engine}",
            "batch.micro_batch_size=1",
            "batch.global_batch_size=8",
            "train.max_steps=3",
            f"run.output_dir={out}",
            "checkpoint.every_steps=null",
            *extra,
        ],
    )
    assert code == 0
    if rank == 0:
        print("COLLECTIVES " + json.dumps({"per_micro_step": LOG}), flush=True)


if __name__ == "__main__":
    main()
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)
