"""Objectives: what a micro-batch's loss is, behind one small Protocol. The loop never branches on
the objective.

Which objectives exist is the registry ``llmft.plan.objectives`` (pure); this package holds the
torch side a record names (``ObjectiveSpec.runtime``): ``sft`` (next-token loss, normalised by
the global batch's target tokens) and ``preference`` (DPO family, normalised by its pairs).

The contract with the loop (docs/batch.md, docs/preference.md): ``count`` says how much of the
normaliser a micro-batch holds; the loop sums it over the step's micro-batches, all-reduces it
once and hands the global count back as ``num_items``; ``micro_loss`` returns the micro-batch's
loss numerator divided by it, so summed gradients of any split equal the big batch's, and the
sums of its metrics, all-reduced with the step's loss and turned into global-batch means by
``metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from llmft.plan.engines import load
from llmft.plan.layout import RunPlan

if TYPE_CHECKING:
    from llmft.engines import Engine


class Objective(Protocol):
    metric_names: tuple[str, ...]  # the sums ``micro_loss`` returns, in order

    def count(self, batch: dict[str, Any]) -> int:
        """This micro-batch's share of the normaliser (target tokens, or pairs)."""

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss numerator / ``num_items``, the detached sums of ``metric_names`` or None)."""

    def metrics(self, sums: list[float], count: float) -> dict[str, float]:
        """The global-batch means of the step's all-reduced sums (``count``: the global count)."""


def build_objective(plan: RunPlan, engine: Engine) -> Objective:
    """The objective the plan resolved (``ObjectiveSpec.runtime``), over the engine's model."""
    runtime = plan.objective_spec.runtime
    assert runtime is not None, f"objective {plan.objective} has no runtime (refused at resolve)"
    return load(runtime)(plan, engine)


def model_inputs(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What the model's forward takes from a collated batch (not labels, not the pair bookkeeping)."""
    keys = ("input_ids", "attention_mask", "position_ids")
    return {k: batch[k] for k in keys if k in batch}
