"""An objective from outside llmft that reads a recipe section of its own: scaled SFT.

A recipe selects it with ``train.objective: scaled_sft`` and ``train.objective_module:
scaled_sft_objective`` (this file on PYTHONPATH, as tests/ is for the test runner) and sets its
section, ``scaled: {scale: 2.0}``. The module registers the section (a dataclass of ``doc()``
fields, llmft.recipe.sections) and the objective that reads it; nothing inside llmft names either
(docs/design.md, "Adding an objective").

The loss: SFT's (the target tokens' summed loss over the global batch's target tokens) times
``scaled.scale``. Under SGD without clipping, scale s at lr is the same update as SFT at s x lr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmft.data import batch_targets
from llmft.errors import Problem
from llmft.objectives import ObjectiveBase
from llmft.objectives.sft import micro_loss
from llmft.plan.objectives import ObjectiveSpec, register_objective
from llmft.recipe.schema import doc
from llmft.recipe.sections import register_section


@dataclass
class ScaledConfig:
    scale: float = doc(1.0, "Multiplies the SFT loss (train.objective: scaled_sft); > 0.")


register_section("scaled", ScaledConfig, "Scaled SFT's loss (train.objective: scaled_sft).")

RECORD = register_objective(
    ObjectiveSpec(
        name="scaled_sft",
        title="scaled SFT",
        runtime="scaled_sft_objective:ScaledSFTObjective",
        counts="tokens",
        card="scaled_sft (next-token loss times a constant)",  # followed by its scale (card_words)
        reads=("scaled",),
        settings="scaled SFT's settings",
        problems="scaled_sft_objective:scaled_problems",
        summary="scaled_sft_objective:scaled_lines",
        card_words="scaled_sft_objective:card_words",
    )
)


def scaled_problems(recipe, where) -> list[Problem]:
    scale = recipe.scaled.scale
    if scale > 0:
        return []
    return [Problem(where("scaled.scale"), f"is {scale}, but the loss is scaled by a positive number", "Use > 0.")]


def scaled_lines(plan) -> list[str]:
    return [f"scaled SFT: loss x {plan.recipe.scaled.scale}"]


def card_words(spec: ObjectiveSpec, recipe: dict) -> str:
    return f"{spec.card}; scale {(recipe.get('scaled') or {}).get('scale')}"


class ScaledSFTObjective(ObjectiveBase):
    def __init__(self, plan, models) -> None:
        super().__init__(plan, models)
        self.scale = plan.recipe.scaled.scale

    def count(self, batch: dict[str, Any]) -> int:
        return batch_targets(batch)

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor):
        return self.scale * micro_loss(model, batch, num_items), None
