"""An objective from outside llmft: token-weighted SFT, registered by one record and this module.

A recipe selects it with ``train.objective: weighted_sft`` and ``train.objective_module:
weighted_sft_objective`` (this file on PYTHONPATH, as tests/ is for the test runner and its torchrun
children); nothing inside llmft names it (docs/design.md, "Adding an objective").

The loss: each target token's cross-entropy times its weight, summed over the global batch and
divided by the global batch's summed weight (an exact weighted mean, whatever the split). The
weight of a token is ``1 + token_id % 3``, attached to every micro-batch by ``prepare`` before the
loop takes the global count: a stand-in for weights an objective computes from its data before
counting (what a generating objective does with its rollouts and rewards).
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
        card="weighted_sft (next-token loss, each target token weighted by 1 + id % 3)",
    )
)


def token_weights(labels: torch.Tensor) -> torch.Tensor:
    """Each position's weight as a target (0 where the label is ignored)."""
    return torch.where(labels != IGNORE_INDEX, 1.0 + (labels % 3).float(), 0.0)


class WeightedSFTObjective(ObjectiveBase):
    def __init__(self, plan, models) -> None:
        super().__init__(plan, models)
        disable_dropout(models.unwrap())  # a split must not change which units drop

    def prepare(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**mb, "token_weights": token_weights(mb["labels"])} for mb in micro_batches]

    def count(self, batch: dict[str, Any]) -> float:
        return float(batch["token_weights"][:, 1:].sum())  # position t predicts labels[t + 1]

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor):
        logits = model(**model_inputs(batch), use_cache=False).logits.float()
        targets = batch["labels"][:, 1:]
        weights = batch["token_weights"][:, 1:]
        losses = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        loss = (losses * weights.reshape(-1)).sum() / num_items
        return loss, (targets != IGNORE_INDEX).sum().double().reshape(1)
