"""One process, one device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmft.engines import OptimizerFactory
from llmft.engines.base import LocalEngine, load_plain, save_plain, unsharded_frozen_model
from llmft.job.dist import DistEnv
from llmft.model.build import prepare_model
from llmft.plan.layout import RunPlan


class SingleEngine(LocalEngine):
    def __init__(self, plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> None:
        super().__init__(plan, env, tokenizer)
        self.model = prepare_model(plan, tokenizer, self.device)
        self.optimizer = make_optimizer(self.model)

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        return unsharded_frozen_model(plan, self.tokenizer, self.device, self.model)

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        save_plain(self.model, self.optimizer, directory, save_optimizer=save_optimizer)

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        load_plain(self.model, self.optimizer, directory, self.device, load_optimizer=load_optimizer)
