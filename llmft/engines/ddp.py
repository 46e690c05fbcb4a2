"""PyTorch DDP: full replicas, one all-reduce per optimizer step (``no_sync`` elsewhere)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from llmft.dist import DistEnv, barrier
from llmft.engines import autocast_for
from llmft.engines.single import (
    MODEL_DIR,
    clip_and_step,
    compute_dtype,
    load_model_weights,
    load_optimizer_state,
    prepare_model,
    save_plain,
)
from llmft.optim import build_optimizer, scaled_lr
from llmft.plan.batch import BatchPlan
from llmft.recipe.schema import Recipe


class DDPEngine:
    name = "ddp"

    def __init__(self, recipe: Recipe, env: DistEnv, plan: BatchPlan, tokenizer, total_steps: int) -> None:
        self.env = env
        self.device = env.device
        self.dtype = compute_dtype(recipe)
        # DDP averages gradients over ranks; our loss is already normalised by the global token count.
        self.grad_scale = float(env.world_size)
        inner = prepare_model(recipe, tokenizer, self.device)
        self.model = DDP(
            inner,
            device_ids=[env.local_rank] if self.device.type == "cuda" else None,
            find_unused_parameters=False,
        )
        self.optimizer = build_optimizer(inner, recipe.optim, scaled_lr(recipe.optim, plan.global_batch_size))
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    def micro_step(self, boundary: bool) -> ContextManager:
        return contextlib.nullcontext() if boundary else self.model.no_sync()

    def autocast(self) -> ContextManager:
        return autocast_for(self.dtype, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm: float | None) -> float:
        return clip_and_step(self.model.module, self.optimizer, self.scaler, max_grad_norm)

    def unwrap(self) -> torch.nn.Module:
        return self.model.module

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        # Replicas are identical: rank 0 writes, like a single process.
        if self.env.is_main:
            save_plain(self.model.module, self.optimizer, directory, save_optimizer=save_optimizer)
        barrier()

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        load_model_weights(self.model.module, directory / MODEL_DIR)
        if load_optimizer:
            load_optimizer_state(self.optimizer, directory, self.device)
