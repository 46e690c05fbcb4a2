"""PyTorch DDP: full replicas, one all-reduce per optimizer step (``no_sync`` elsewhere)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from llmft.engines import OptimizerFactory
from llmft.engines.base import LocalEngine, load_plain, save_plain, unsharded_frozen_model
from llmft.job.dist import DistEnv, barrier, sequence_group, world_mesh
from llmft.model import ulysses
from llmft.model.build import prepare_model
from llmft.plan.layout import RunPlan


class DDPEngine(LocalEngine):
    def __init__(self, plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> None:
        super().__init__(plan, env, tokenizer)  # DDP averages gradients over ranks: backward undoes it
        inner = prepare_model(plan, tokenizer, self.device)
        if plan.sequence_parallel > 1:  # the all-reduce averages over every rank: backward scales by the world
            ulysses.install(inner, sequence_group(plan.layout.mesh))
        self.model = DDP(
            inner,
            device_ids=[env.local_rank] if self.device.type == "cuda" else None,
            find_unused_parameters=False,
            process_group=world_mesh(self.device.type).get_group(),  # the default group: every rank
        )
        self.optimizer = make_optimizer(inner)

    def micro_step(self, boundary: bool) -> ContextManager:
        return contextlib.nullcontext() if boundary else self.model.no_sync()

    def unwrap(self):
        return self.model.module

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        return unsharded_frozen_model(plan, self.tokenizer, self.device, self.unwrap())

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        # Replicas are identical: rank 0 writes, like a single process.
        if self.env.is_main:
            save_plain(self.model.module, self.optimizer, directory, save_optimizer=save_optimizer)
        barrier()

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        load_plain(self.model.module, self.optimizer, directory, self.device, load_optimizer=load_optimizer)
