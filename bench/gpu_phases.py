"""Where the time of a training step goes: ``llmft train RECIPE`` with two steps added at the end,
one timed by phase and one under ``torch.profiler``. bench/gpu.py runs each case's "all on" variant
through this script (its table's medians leave the two added steps out).

    python bench/gpu_phases.py RECIPE --steps N      # N: the recipe's steps; N + 2 are run

Step N + 1 is timed by phase, with a device synchronize around each so that the GPU's work is
charged to the phase that queued it: data wait (fetching the step's micro-batches), forward (model
and loss of every micro-batch), backward, optimizer (clipping, the step, zeroing). Step N + 2 runs
under ``torch.profiler``: the kernels with the most device time (CPU ops on a CPU). Both go to
``<recipe>.phases.json``, which bench/gpu.py prints under "Where the time goes".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from common import ROOT  # noqa: F401  (puts the checkout on sys.path)

TOP = 10


class Phases:
    """Per-phase seconds of the steps while ``on``; the profiler of the step while ``profiling``."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.on = cuda, False
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.profiler: Any = None

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def wrapper(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0
            return out

        return wrapper


def top_kernels(profiler, cuda: bool) -> list[dict[str, Any]]:
    """The ``TOP`` entries with the most own device time (CPU time on a CPU), in milliseconds."""

    def own(e) -> float:
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted(profiler.key_averages(), key=own, reverse=True)[:TOP]
    return [{"name": e.key[:90], "ms": own(e) / 1000, "calls": e.count} for e in events if own(e) > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, required=True, help="the recipe's steps; two more are run")
    args = ap.parse_args()

    import torch

    from llmft.metrics import record as llmft_metrics
    from llmft.training import run as llmft_run
    from llmft.training import train as llmft_train

    cuda = torch.cuda.is_available()
    phases = Phases(cuda)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    original_setup, original_write = llmft_run.Run.setup, llmft_metrics.Metrics.write

    def setup(self):
        resume = original_setup(self)
        self.objective.micro_loss = phases.timed("forward", self.objective.micro_loss)
        self.engine.backward = phases.timed("backward", self.engine.backward)
        self.engine.step = phases.timed("optimizer", self.engine.step)
        return resume

    def write(self, row):
        original_write(self, row)
        if row.get("split") != "train":
            return
        step = row["step"]
        if step == args.steps + 1:  # the timed step ended
            phases.on = False
            result["step_s"] = row["step_time_s"]
            result["data_wait_s"] = row["data_wait_frac"] * row["step_time_s"]
            result.update({f"{k}_s": v for k, v in phases.seconds.items()})
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            phases.profiler = torch.profiler.profile(activities=activities)
            phases.profiler.__enter__()
        elif step == args.steps + 2 and phases.profiler is not None:
            phases.profiler.__exit__(None, None, None)
            result["kernels"] = top_kernels(phases.profiler, cuda)
        elif step == args.steps:
            phases.on = True

    llmft_run.Run.setup, llmft_metrics.Metrics.write = setup, write
    try:
        code = llmft_train.train(args.recipe, [f"train.max_steps={args.steps + 2}"])
    finally:
        llmft_run.Run.setup, llmft_metrics.Metrics.write = original_setup, original_write
    Path(args.recipe).with_suffix(".phases.json").write_text(json.dumps(result, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
