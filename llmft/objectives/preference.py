"""Preference objectives (``train.objective: dpo``): the DPO family on chosen/rejected pairs.

A micro-batch is the contract batch of docs/preference.md: rows of chosen and rejected sequences
(unpacked, or packed padding-free), ``sequence_index`` naming the sequence of every token
(sequence ``2p`` is pair ``p``'s chosen, ``2p + 1`` its rejected, -1 padding) and ``num_pairs``.

- Per-sequence log-prob (``llmft.objectives.sequences``): the sum of the target tokens' log-probs,
  gathered per sequence with one ``index_add`` (no Python loop over sequences), so a packed row and padded rows give the same
  numbers. ``ipo``, ``simpo`` and ``orpo`` use the mean per target token.
- Loss: the mean over ALL pairs of the global batch. ``micro_loss`` returns the sum of this
  micro-batch's pair losses divided by the global pair count (``num_items``): any split of the
  batch over micro-steps, ranks and a short last window is the same step (docs/batch.md).
- Reference: the plan's ``reference`` (llmft.plan.objectives): the policy itself with its
  adapters disabled (LoRA/QLoRA; also when the engine shards it: the sharded model, never a
  gathered copy), a frozen model the objective asks the engine for (``Engine.frozen_model``: a
  frozen copy, or the model ``preference.reference`` names, built and sharded like the policy;
  ``reference.frozen_reference``), or none (``simpo``, ``orpo``). Always without grad.
- Any layout: the per-sequence sums are whole over a sequence group's slices
  (``sequences.SequenceSlices``), so the loss is written once.
- Dropout is off in the policy and the reference (every dropout probability set to 0 when the
  objective is built): the policy's and the reference's log-probs of a sequence must be the same
  function of the weights, or the implicit reward is noise, and a micro-batch split must not
  change which units are dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.nn.functional as F

from llmft.objectives import Models, ObjectiveBase, ObjectiveSetup, disable_dropout
from llmft.objectives.reference import frozen_reference, precompute_references, precomputing
from llmft.objectives.sequences import (
    SequenceSlices,
    model_sequence_logps,
    predicted_tokens,
    sum_per_sequence,
)
from llmft.plan.layout import RunPlan
from llmft.plan.objectives import ADAPTERS_DISABLED, NO_REFERENCE

if TYPE_CHECKING:
    from llmft.recipe.schema import PreferenceConfig

# Losses on the mean log-prob per target token (length-normalised); the others use the sum.
MEAN_LOGP_LOSSES = ("ipo", "simpo", "orpo")


@dataclass
class PairLosses:
    """Per pair: the loss and what the metrics report (all ``[P]``)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def pair_losses(
    cfg: PreferenceConfig,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
) -> PairLosses:
    """The per-pair losses of ``cfg.loss_type`` (formulas: docs/preference.md, as TRL's trainers).

    ``chosen``/``rejected``: the policy's per-sequence log-probs (sums, or per-token means for
    ``MEAN_LOGP_LOSSES``), the reference's the same way (None for the reference-free losses)."""
    beta, kind = cfg.beta, cfg.loss_type
    if kind in ("simpo", "orpo"):
        chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
        if kind == "simpo":
            losses = -F.logsigmoid(beta * (chosen - rejected) - cfg.simpo_gamma)
        else:  # ORPO: the chosen NLL (per token) minus beta * log sigmoid(log odds ratio)
            log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
            losses = -chosen - beta * F.logsigmoid(log_odds)
        return PairLosses(losses, chosen_rewards.detach(), rejected_rewards.detach(), chosen, rejected)
    assert ref_chosen is not None and ref_rejected is not None
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":  # DPO; label_smoothing > 0: conservative DPO (cDPO)
        ls = cfg.label_smoothing
        losses = -F.logsigmoid(beta * h) * (1 - ls) - F.logsigmoid(-beta * h) * ls
    elif kind == "hinge":
        losses = torch.relu(1 - beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise AssertionError(f"unknown loss_type {kind!r}")
    return PairLosses(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach(), chosen, rejected)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation near 0 or underflow far below it."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class PreferenceObjective(ObjectiveBase):
    """DPO and its relatives over the contract batch (see the module docstring)."""

    def __init__(self, plan: RunPlan, models: Models) -> None:
        super().__init__(plan, models)
        self.cfg = plan.recipe.preference
        self.mean_logps = self.cfg.loss_type in MEAN_LOGP_LOSSES
        self.reference_kind = plan.reference
        self.policy = models.unwrap()  # the HF / PEFT model (sharded in place under FSDP2 / ZeRO-3)
        # preference.precompute_reference: every batch carries ``reference_logps`` (the sums, set up
        # by ``setup``: llmft.objectives.reference); no reference model is held or run.
        self.precomputed = precomputing(plan)
        self.reference = None if self.precomputed else frozen_reference(plan, models)
        self.models = models
        disable_dropout(self.policy)
        if self.reference is not None:
            disable_dropout(self.reference)
        self.slices = SequenceSlices(plan.layout)

    def setup(self, context: ObjectiveSetup) -> None:
        """The precomputed reference log-probs, read from beside the data cache or computed in one
        sharded pass (before a checkpoint is loaded: a full fine-tune's reference is the policy's
        initial weights)."""
        if self.precomputed:
            precompute_references(self.plan, self.models, context.data, context.env, context.tokenizer.pad_token_id)

    def count(self, batch: dict[str, Any]) -> int:
        return self.slices.count(int(batch["num_pairs"]))

    def _logps(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) per-sequence log-probs of ``model``, ``[P]`` each, as the loss uses them."""
        sums, counts = model_sequence_logps(model, batch, 2 * int(batch["num_pairs"]))
        sums, counts = self.slices.whole(sums), self.slices.whole(counts.detach())
        logps = sums / counts.clamp_min(1.0) if self.mean_logps else sums
        return logps[0::2], logps[1::2]

    def _reference_logps(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.reference_kind == NO_REFERENCE:
            return None
        if self.precomputed:  # sums stored with the cache entry; a mean divides by the same counts
            assert "reference_logps" in batch, "precompute_reference: the collator adds reference_logps"
            ref = batch["reference_logps"].float()
            if self.mean_logps:
                ref = ref / self._target_counts(batch, ref.numel()).clamp_min(1.0)
            return ref[0::2], ref[1::2]
        model, scope = self.reference, contextlib.nullcontext()
        if self.reference_kind == ADAPTERS_DISABLED:
            model, scope = self.policy, self._adapters_disabled()
        with torch.no_grad(), scope:
            return self._logps(model, batch)

    def _target_counts(self, batch: dict[str, Any], num_sequences: int) -> torch.Tensor:
        """Target tokens per sequence, as ``model_sequence_logps`` counts them (over the whole sequence)."""
        _, valid = predicted_tokens(batch)
        return self.slices.whole(sum_per_sequence(valid.float(), valid, batch["sequence_index"], num_sequences)[1])

    def _adapters_disabled(self) -> ContextManager:
        return self.policy.disable_adapter()  # PEFT: the base weights alone, in place (sharded or not)

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ref = self._reference_logps(batch)
        chosen, rejected = self._logps(model, batch)
        out = pair_losses(self.cfg, chosen, rejected, *(ref if ref is not None else (None, None)))
        # With sequence parallelism every rank of the group computes the same pair losses from the
        # summed log-probs: each takes its share.
        loss = self.slices.share(out.losses.sum() / num_items)
        correct = (out.chosen_rewards > out.rejected_rewards).float()
        margin = out.chosen_rewards - out.rejected_rewards
        sums = torch.stack(
            [
                out.chosen_rewards.sum(),
                out.rejected_rewards.sum(),
                correct.sum(),
                margin.sum(),
                out.chosen_logps.detach().sum(),
                out.rejected_logps.detach().sum(),
            ]
        )
        return loss, self.slices.share(sums)
