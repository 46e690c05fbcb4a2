"""An objective from outside llmft: weighted SFT, registered by one record and this module.

A recipe selects it with ``train.objective: weighted_sft`` and ``train.objective_module:
weighted_sft_objective`` (this file on PYTHONPATH, as tests/ is for the test runner and its torchrun
children); nothing inside llmft names it (docs/design.md, "Adding an objective").

Each record carries a ``weight`` (a number). The record declares it (``fields=("weight",)``), so
the data layer stores it with each record through the token cache and delivers it in every
micro-batch as ``batch["weight"]``: each token its record's weight, packed rows included
(docs/data.md "Record fields"). The loss: each target token's cross-entropy times its record's
weight, summed over the global batch and divided by the global batch's summed target weight (an
exact weighted mean, whatever the split). ``prepare`` (the stage the loop runs before it takes
the global count) attaches each target's weight to every micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmft.model.loss import IGNORE_INDEX
from llmft.objectives import ObjectiveBase, disable_dropout, model_inputs
from llmft.plan.objectives import ObjectiveSpec, register_objective

RECORD = register_objective(
    ObjectiveSpec(
        name="weighted_sft",
        title="token-weighted SFT",
        runtime="weighted_sft_objective:WeightedSFTObjective",
        counts="tokens",
        metrics=("weighted/targets_per_weight",),
        fields=("weight",),
        card="weighted_sft (next-token loss, each target token weighted by its record's weight)",
    )
)


def target_weights(batch: dict[str, Any]) -> torch.Tensor:
    """The weight of each position's target: position t predicts labels[t + 1] (0 where ignored)."""
    targets = batch["labels"][:, 1:]
    return torch.where(targets != IGNORE_INDEX, batch["weight"][:, 1:], 0.0)


class WeightedSFTObjective(ObjectiveBase):
    def __init__(self, plan, models) -> None:
        super().__init__(plan, models)
        disable_dropout(models.unwrap())  # a split must not change which units drop

    def prepare(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each target's weight, once per micro-batch, before the loop takes the global count."""
        return [{**mb, "target_weights": target_weights(mb)} for mb in micro_batches]

    def count(self, batch: dict[str, Any]) -> float:
        return float(batch["target_weights"].sum())

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor):
        logits = model(**model_inputs(batch), use_cache=False).logits.float()
        targets = batch["labels"][:, 1:]
        weights = batch["target_weights"]
        losses = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        loss = (losses * weights.reshape(-1)).sum() / num_items
        return loss, (targets != IGNORE_INDEX).sum().double().reshape(1)
