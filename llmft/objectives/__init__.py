"""Objectives: what a micro-batch's loss is, behind one small Protocol. The loop never branches on
the objective.

Which objectives exist is the registry ``llmft.plan.objectives`` (pure); this package holds the
torch side a record names (``ObjectiveSpec.runtime``): ``sft`` (next-token loss, normalised by
the global batch's target tokens), ``preference`` (the DPO family, normalised by its pairs) and
``reward`` (a reward model's score head, normalised by its pairs); a user's module may name its
own (docs/design.md, "Adding an objective").

The life of an objective in a run (``llmft.training.run``, ``llmft.training.loop``):

1. built from the plan's record over the engine's model (``build_objective``): it asks the engine
   for the frozen models its record needs (``Engine.frozen_model``);
2. ``setup(context)``: once, after the data and the engine exist and before a checkpoint is
   loaded (the DPO reference log-probs are precomputed here);
3. each step, ``prepare(micro_batches)``: the step's micro-batches before anything counts them
   (where an objective that generates would generate and score); then ``count``: how much of the
   normaliser a micro-batch holds; the loop sums it over the step's micro-batches, all-reduces it
   once and hands the global count back as ``num_items``; ``micro_loss`` returns the micro-batch's
   loss numerator divided by it, so summed gradients of any split equal the big batch's, and the
   sums of its metrics, all-reduced with the step's loss and turned into global-batch means by
   ``metrics``.

``ObjectiveBase`` gives the defaults (no set-up, micro-batches as they come, metrics as
global-batch means of the record's ``metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llmft.plan.engines import load
from llmft.plan.layout import RunPlan

if TYPE_CHECKING:
    from llmft.data.bundle import DataBundle
    from llmft.job.dist import DistEnv


class Models(Protocol):
    """What an objective asks of the engine for its models (``Engine`` is one; ``llmft verify``
    builds a one-process one, ``engines.base.OneProcessModels``)."""

    def unwrap(self) -> torch.nn.Module:
        """The policy: the Hugging Face / PEFT model the engine trains."""

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        """A frozen model built and sharded like the policy (``Engine.frozen_model``)."""

    def place_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model built by its caller, held as the policy's weights are (``Engine.place_frozen``)."""


@dataclass
class ObjectiveSetup:
    """What an objective's set-up step may read: the run's data, its place in the world, the tokenizer."""

    data: DataBundle
    env: DistEnv
    tokenizer: Any


class Objective(Protocol):
    metric_names: tuple[str, ...]  # the sums ``micro_loss`` returns, in order (the record's ``metrics``)

    def setup(self, context: ObjectiveSetup) -> None:
        """Once per run, after the engine and the data exist, before a checkpoint is loaded."""

    def prepare(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The step's micro-batches, made ready before the global count is taken (generate, score)."""

    def count(self, batch: dict[str, Any]) -> float:
        """This micro-batch's share of the normaliser (target tokens, pairs, completions; a weighted
        count may be fractional)."""

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss numerator / ``num_items``, the detached sums of ``metric_names`` or None)."""

    def metrics(self, sums: list[float], count: float) -> dict[str, float]:
        """The global-batch means of the step's all-reduced sums (``count``: the global count)."""

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's part of what the objective keeps across steps, saved with each checkpoint
        (tensors, numbers, lists: loaded with ``weights_only``); None: nothing."""

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Every rank's saved part, in rank order (another world size may resume it)."""

    def evaluate(self, dataset: Any, env: DistEnv, max_items: int | None) -> dict[str, float] | None:
        """The eval row of an objective that evaluates otherwise than by its loss over the eval set
        (online RL: the held-out reward of greedy completions); None: the loss eval (``Evaluator``)."""

    looks_ahead: bool  # True: the loop hands ``look_ahead`` the next step's micro-batches first (rollout.async)

    def look_ahead(self, micro_batches: list[dict[str, Any]]) -> None:
        """The next step's micro-batches, before this step's ``prepare`` (only when ``looks_ahead``)."""

    def close(self) -> None:
        """Once, when the run ends (also on an error), before the process group goes: what ``setup``
        started (a generation engine) stops."""


class ObjectiveBase:
    """The defaults of an ``Objective``: subclasses write ``count`` and ``micro_loss``."""

    def __init__(self, plan: RunPlan, models: Models) -> None:
        self.plan = plan
        self.metric_names: tuple[str, ...] = plan.objective_spec.metrics  # the record's (llmft.plan.objectives)

    def setup(self, context: ObjectiveSetup) -> None:
        pass

    def prepare(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return micro_batches

    def metrics(self, sums: list[float], count: float) -> dict[str, float]:
        return {name: value / max(count, 1.0) for name, value in zip(self.metric_names, sums, strict=True)}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        pass

    def evaluate(self, dataset: Any, env: DistEnv, max_items: int | None) -> dict[str, float] | None:
        return None

    looks_ahead = False

    def look_ahead(self, micro_batches: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def build_objective(plan: RunPlan, models: Models) -> Objective:
    """The objective the plan resolved (``ObjectiveSpec.runtime``), over the engine's model."""
    runtime = plan.objective_spec.runtime
    assert runtime is not None, f"objective {plan.objective} has no runtime (refused at resolve)"
    return load(runtime)(plan, models)


def model_inputs(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What the model's forward takes from a collated batch (not labels, not the pair bookkeeping)."""
    keys = ("input_ids", "attention_mask", "position_ids")
    return {k: batch[k] for k in keys if k in batch}


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout probability of ``model`` to 0: ``nn.Dropout`` modules (LoRA's included) and
    the attention-probability dropout transformers' attention modules read from ``attention_dropout``."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
