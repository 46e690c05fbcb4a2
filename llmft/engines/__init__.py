"""Engines: one small Protocol, four implementations. The loop never branches on the engine.

Who divides the loss by what (docs/batch.md has the full story): the loop's loss
for a micro-batch is ``sum of its token losses / target tokens of the whole
global batch``, so summing gradients over micro-steps and ranks gives exactly the
big-batch gradient. Engines that average instead of sum (DDP and FSDP mean over
ranks, DeepSpeed over ranks and, unless told otherwise, micro-steps) declare
``grad_scale``; the loop multiplies the loss by it before ``backward``. That is
the one place where the engine's own averaging is undone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch

from llmft.dist import DistEnv
from llmft.plan.batch import BatchPlan
from llmft.recipe.schema import Recipe


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


# Fresh models (model.config) up to this size are built whole on every rank with the seeded init and
# then sharded, so their weights equal the single-process run's; larger ones and every pretrained model
# are built already sharded (FSDP2: on the meta device, ZeRO-3: under zero.Init). SPEC item 7.
WHOLE_INIT_MAX_PARAMS = 1_000_000_000


def builds_whole(recipe: Recipe) -> bool:
    """Whether a sharding engine may build this recipe's model whole on every rank before sharding it."""
    from llmft.plan.shape import model_shape

    shape = model_shape(recipe.model)
    return recipe.model.config is not None and shape is not None and shape.num_params <= WHOLE_INIT_MAX_PARAMS


def autocast_for(dtype: torch.dtype, device: torch.device) -> ContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_engine(recipe: Recipe, env: DistEnv, plan: BatchPlan, tokenizer, total_steps: int) -> Engine:
    name = recipe.distributed.engine
    if name == "single":
        from llmft.engines.single import SingleEngine

        return SingleEngine(recipe, env, plan, tokenizer, total_steps)
    if name == "ddp":
        from llmft.engines.ddp import DDPEngine

        return DDPEngine(recipe, env, plan, tokenizer, total_steps)
    if name == "fsdp":
        from llmft.engines.fsdp import FSDPEngine

        return FSDPEngine(recipe, env, plan, tokenizer, total_steps)
    if name == "deepspeed":
        from llmft.engines.deepspeed import DeepSpeedEngineAdapter

        return DeepSpeedEngineAdapter(recipe, env, plan, tokenizer, total_steps)
    raise AssertionError(f"unresolved engine {name!r}")
