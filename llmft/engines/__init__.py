"""Engines: one small Protocol, four implementations. The loop never branches on the engine.

Which engines exist, and what each can do, is the registry ``llmft.plan.engines`` (pure: the
planner and the compiler read it without torch); this module builds the runtime side a record
names (``EngineSpec.runtime``, ``EngineSpec.reader``).

Who divides the loss by what (docs/batch.md has the full story): the loop's loss
for a micro-batch is ``sum of its item losses / the objective's count over the whole
global batch`` (target tokens, pairs, ...: ``ObjectiveSpec.counts``), so summing gradients over micro-steps and ranks gives exactly the
big-batch gradient. Engines that average instead of sum (DDP and FSDP mean over
ranks, DeepSpeed over ranks and, unless told otherwise, micro-steps) undo it in their
own ``backward``: the one place where the engine's own averaging is undone. Clipping
(``optim.max_grad_norm``, read from the plan) is set when the engine is built.

Each engine owns its checkpoint format: ``save`` / ``load`` in a run, and an offline
``read_checkpoint`` (one process, no process group) that export and consolidation use.
The names of the files are in ``llmft.checkpoint.layout``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import torch

from llmft.job.dist import DistEnv
from llmft.plan.engines import engine_spec, load
from llmft.plan.layout import RunPlan

# Builds the run's optimizer over a prepared (wrapped, sharded) model: one place, llmft.training.optim.
OptimizerFactory = Callable[[torch.nn.Module], Any]


class Engine(Protocol):
    name: str
    model: torch.nn.Module  # what the loop calls forward on
    optimizer: Any  # the optimizer the scheduler drives

    def micro_step(self, boundary: bool) -> ContextManager:
        """Wraps forward + backward of one micro-batch; gradients are reduced only when ``boundary``."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the loop's micro loss (normalised by the objective's global count); the
        engine undoes its own averaging over ranks / micro-steps, so the summed gradients are the
        big batch's."""

    def step(self) -> float:
        """Clip (to the plan's ``max_grad_norm``), optimizer step, zero grads. Returns the global
        gradient norm before clipping."""

    def unwrap(self) -> torch.nn.Module:
        """The Hugging Face / PEFT model inside."""

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        """A frozen model (no gradients, no optimizer, eval mode) built and sharded like the policy:
        ``plan``'s model (``RunPlan.frozen_model_plan``: a named reference or reward model), or, with
        no plan, a copy of the policy as built (its initial weights: asked before any step). What an
        objective's record says it needs (``ObjectiveSpec.frozen``); "the policy with its adapters
        off" needs no model: ``unwrap().disable_adapter()``."""

    def place_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model its caller built whole (a reward model), held as the policy's weights are:
        whole on this rank's device (single, DDP), sharded like the policy (FSDP2, ZeRO-3)."""

    def autocast(self) -> ContextManager: ...

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        """Write model and optimizer state in the engine's own format (collective)."""

    def load(self, directory: Path, *, load_optimizer: bool) -> None: ...


def autocast_for(dtype: torch.dtype, device: torch.device) -> ContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_engine(plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> Engine:
    """The engine the plan resolved (``EngineSpec.runtime``), with the model built and prepared."""
    return load(plan.spec.runtime)(plan, env, tokenizer, make_optimizer)


def read_checkpoint(engine: str, model: torch.nn.Module, step_dir: Path) -> None:
    """Load the weights a checkpoint of ``engine`` holds into ``model`` (built whole, or with only
    its trainable part materialised for an adapter), in one process without a process group."""
    load(engine_spec(engine).reader)(model, step_dir)
