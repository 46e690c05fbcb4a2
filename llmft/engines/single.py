"""One process, one device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmft.dist import DistEnv
from llmft.engines import OptimizerFactory
from llmft.engines.base import LocalEngine, load_plain, save_plain, unsharded_reference
from llmft.model.build import prepare_model
from llmft.plan.layout import RunPlan


class SingleEngine(LocalEngine):
    def __init__(self, plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> None:
        super().__init__(plan, env)
        self.model = prepare_model(plan, tokenizer, self.device)
        self.reference = unsharded_reference(plan, tokenizer, self.device, self.model)
        self.optimizer = make_optimizer(self.model)

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        save_plain(self.model, self.optimizer, directory, save_optimizer=save_optimizer)

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        load_plain(self.model, self.optimizer, directory, self.device, load_optimizer=load_optimizer)
