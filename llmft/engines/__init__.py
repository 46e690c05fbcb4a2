"""Engines: one small Protocol, four implementations. The loop never branches on the engine.

Who divides the loss by what (docs/batch.md has the full story): the loop's loss
for a micro-batch is ``sum of its token losses / target tokens of the whole
global batch``, so summing gradients over micro-steps and ranks gives exactly the
big-batch gradient. Engines that average instead of sum (DDP and FSDP mean over
ranks, DeepSpeed over ranks and, unless told otherwise, micro-steps) declare
``grad_scale``; the loop multiplies the loss by it before ``backward``. That is
the one place where the engine's own averaging is undone.

Each engine owns its checkpoint format: ``save`` / ``load`` in a run, and an offline
``read_checkpoint`` (one process, no process group) that export and consolidation use.
The names of the files are in ``llmft.checkpoint.layout``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import torch

from llmft.dist import DistEnv
from llmft.plan.resolve import RunPlan

# Builds the run's optimizer over a prepared (wrapped, sharded) model: one place, llmft.optim.
OptimizerFactory = Callable[[torch.nn.Module], Any]


class Engine(Protocol):
    name: str
    model: torch.nn.Module  # what the loop calls forward on
    optimizer: Any  # the optimizer the scheduler drives
    grad_scale: float  # undoes the engine's averaging over ranks / micro-steps

    def micro_step(self, boundary: bool) -> ContextManager:
        """Wraps forward + backward of one micro-batch; gradients are reduced only when ``boundary``."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, max_grad_norm: float | None) -> float:
        """Clip, optimizer step, zero grads. Returns the global gradient norm before clipping."""

    def unwrap(self) -> torch.nn.Module:
        """The Hugging Face / PEFT model inside."""

    def autocast(self) -> ContextManager: ...

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        """Write model and optimizer state in the engine's own format (collective)."""

    def load(self, directory: Path, *, load_optimizer: bool) -> None: ...


def autocast_for(dtype: torch.dtype, device: torch.device) -> ContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_engine(plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> Engine:
    name = plan.engine
    if name == "single":
        from llmft.engines.single import SingleEngine

        return SingleEngine(plan, env, tokenizer, make_optimizer)
    if name == "ddp":
        from llmft.engines.ddp import DDPEngine

        return DDPEngine(plan, env, tokenizer, make_optimizer)
    if name == "fsdp":
        from llmft.engines.fsdp import FSDPEngine

        return FSDPEngine(plan, env, tokenizer, make_optimizer)
    if name == "deepspeed":
        from llmft.engines.deepspeed import DeepSpeedEngineAdapter

        return DeepSpeedEngineAdapter(plan, env, tokenizer, make_optimizer)
    raise AssertionError(f"unresolved engine {name!r}")


def read_checkpoint(engine: str, model: torch.nn.Module, step_dir: Path) -> None:
    """Load the weights a checkpoint of ``engine`` holds into ``model`` (built whole, or with only
    its trainable part materialised for an adapter), in one process without a process group."""
    if engine in ("single", "ddp"):
        from llmft.engines.base import read_plain

        return read_plain(model, step_dir)
    if engine == "fsdp":
        from llmft.engines.fsdp import read_dcp

        return read_dcp(model, step_dir)
    if engine == "deepspeed":
        from llmft.engines.deepspeed import read_deepspeed

        return read_deepspeed(model, step_dir)
    raise AssertionError(f"unknown engine {engine!r} in a checkpoint")
