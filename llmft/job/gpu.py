"""The GPU this process sees, measured for the planner: ``llmft.plan`` imports no torch, so the
runtime (``llmft train``) and ``llmft plan`` hand it this measurement (a callable, called only when
the recipe leaves ``distributed.gpu_memory_gb`` unset and the plan needs a number)."""

from __future__ import annotations

import importlib.util

GIB = 2**30  # as plan.memory counts; this package sits below plan/ (plan.memory reads job.malloc)


def gpu_memory_gb() -> float | None:
    """Total memory of GPU 0 in GiB, when torch is installed and sees a GPU; else None."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB
