"""Preference objectives (``train.objective: dpo``): the DPO family on chosen/rejected pairs.

A micro-batch is the contract batch of docs/preference.md: rows of chosen and rejected sequences
(unpacked, or packed padding-free), ``sequence_index`` naming the sequence of every token
(sequence ``2p`` is pair ``p``'s chosen, ``2p + 1`` its rejected, -1 padding) and ``num_pairs``.

- Per-sequence log-prob: the sum of the target tokens' log-probs, gathered per sequence with one
  ``index_add`` (no Python loop over sequences), so a packed row and padded rows give the same
  numbers. ``ipo``, ``simpo`` and ``orpo`` use the mean per target token.
- Loss: the mean over ALL pairs of the global batch. ``micro_loss`` returns the sum of this
  micro-batch's pair losses divided by the global pair count (``num_items``): any split of the
  batch over micro-steps, ranks and a short last window is the same step (docs/batch.md).
- Reference: the plan's ``reference`` (llmft.plan.objectives): the policy itself with its
  adapters disabled (LoRA/QLoRA; also when the engine shards it: the sharded model, never a
  gathered copy), ``engine.reference`` (a frozen copy, or the model ``preference.reference``
  names, built and sharded like the policy), or none (``simpo``, ``orpo``). Always without grad.
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
from torch.distributed.nn.functional import all_reduce

from llmft import loss as lm_loss
from llmft.loss import IGNORE_INDEX
from llmft.model.ulysses import sequence_groups
from llmft.objectives import model_inputs
from llmft.plan.layout import RunPlan
from llmft.plan.objectives import ADAPTERS_DISABLED, NO_REFERENCE

if TYPE_CHECKING:
    from llmft.engines import Engine
    from llmft.recipe.schema import PreferenceConfig

# Losses on the mean log-prob per target token (length-normalised); the others use the sum.
MEAN_LOGP_LOSSES = ("ipo", "simpo", "orpo")


def predicted_targets(labels: torch.Tensor, sequence_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token each position predicts, whether that prediction counts), both ``[R, T]``.

    Position t predicts ``labels[t + 1]`` (labels are unshifted, as for SFT); a prediction counts
    only inside one sequence (in a packed row the last token of a sequence does not predict the
    first of the next) and only on target tokens. The last position predicts nothing (token 0,
    not counted)."""
    target = labels[:, 1:]
    seq = sequence_index[:, 1:]
    valid = (target != IGNORE_INDEX) & (seq >= 0) & (seq == sequence_index[:, :-1])
    safe = torch.where(valid, target, 0)
    return F.pad(safe, (0, 1), value=0), F.pad(valid, (0, 1), value=False)


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of target-token log-probs, number of target tokens) per sequence, both ``[num_sequences]``,
    from the logits ``[R, T, V]`` (rules: ``predicted_targets``)."""
    target, valid = predicted_targets(labels, sequence_index)
    token_logps = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none")
    return sum_per_sequence(token_logps.reshape(target.shape), valid, sequence_index, num_sequences)


def sum_per_sequence(
    token_logps: torch.Tensor, valid: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the counted ``token_logps``, their number) per sequence: one ``index_add`` each."""
    token_logps = torch.where(valid, token_logps, 0.0).reshape(-1)
    index = torch.where(valid, sequence_index, 0).reshape(-1)
    valid = valid.reshape(-1)
    sums = token_logps.new_zeros(num_sequences).index_add(0, index, token_logps)
    counts = token_logps.new_zeros(num_sequences).index_add(0, index, valid.float())
    return sums, counts


def batch_targets(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token each position predicts, whether that prediction counts), both ``[R, T]``, of a
    collated pair batch (``predicted_targets``) or of a sequence slice, whose ``shift_labels`` are
    already shifted and cut where a sequence ends (``llmft.data.sequence``)."""
    index = batch["sequence_index"]
    if "shift_labels" not in batch:
        return predicted_targets(batch["labels"], index)
    shift = batch["shift_labels"]
    valid = (shift != IGNORE_INDEX) & (index >= 0)
    return torch.where(valid, shift, 0), valid


def model_sequence_logps(
    model: torch.nn.Module, batch: dict[str, Any], num_sequences: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of target-token log-probs, number of target tokens) per sequence of a collated pair
    batch, from ``model``'s forward. With the chunked head installed (``llmft.loss``) the model
    returns the targets' log-probs a chunk at a time and never holds the micro-batch's logits.

    A sequence slice (``shift_labels`` in the batch, ``llmft.data.sequence``): position t predicts
    ``shift_labels[t]``, already shifted and cut where a sequence ends; the sums are this slice's
    part, which the sequence group's all-reduce makes whole (``SequenceGroup``)."""
    index = batch["sequence_index"]
    target, valid = batch_targets(batch)
    head = lm_loss.find(model)
    if head is None:
        logits = model(**model_inputs(batch), use_cache=False).logits
        flat = logits.reshape(-1, logits.shape[-1]).float()
        token_logps = -F.cross_entropy(flat, target.reshape(-1), reduction="none").reshape(target.shape)
    else:
        with lm_loss.token_logps(head, target):
            token_logps = model(**model_inputs(batch), use_cache=False).logits
    return sum_per_sequence(token_logps, valid, index, num_sequences)


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


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout probability of ``model`` to 0: ``nn.Dropout`` modules (LoRA's included) and
    the attention-probability dropout transformers' attention modules read from ``attention_dropout``."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class SequenceGroup:
    """The ranks that share each sequence (``distributed.sequence_parallel``): per-sequence sums
    of their slices are summed over the group, with gradients (each rank's slice gets the whole
    sum's gradient)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.group = None
        self.first = True
        if size > 1:
            mpu = sequence_groups(size)
            self.group = mpu.get_sequence_parallel_group()
            self.first = mpu.get_sequence_parallel_rank() == 0

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return values
        return all_reduce(values, group=self.group)


class PreferenceObjective:
    """DPO and its relatives over the contract batch (see the module docstring)."""

    def __init__(self, plan: RunPlan, engine: Engine) -> None:
        self.metric_names = plan.objective_spec.metrics  # the record's (llmft.plan.objectives)
        self.cfg = plan.recipe.preference
        self.mean_logps = self.cfg.loss_type in MEAN_LOGP_LOSSES
        self.reference_kind = plan.reference
        self.policy = engine.unwrap()  # the HF / PEFT model (sharded in place under FSDP2 / ZeRO-3)
        self.reference = getattr(engine, "reference", None)
        # preference.precompute_reference: every batch carries ``reference_logps`` (the sums,
        # llmft.objectives.reference); no reference model is held or run.
        self.precomputed = self.cfg.precompute_reference and plan.reference != NO_REFERENCE
        if plan.reference not in (NO_REFERENCE, ADAPTERS_DISABLED) and not self.precomputed:
            assert self.reference is not None, f"the engine built no reference model for {plan.reference}"
        disable_dropout(self.policy)
        if self.reference is not None:
            disable_dropout(self.reference)
        self.sequence = SequenceGroup(plan.layout.sp)

    def count(self, batch: dict[str, Any]) -> int:
        # Every rank of a sequence group holds the same pairs: the group counts them once.
        return int(batch["num_pairs"]) if self.sequence.first else 0

    def _logps(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) per-sequence log-probs of ``model``, ``[P]`` each, as the loss uses them."""
        sums, counts = model_sequence_logps(model, batch, 2 * int(batch["num_pairs"]))
        if "shift_labels" in batch:  # this rank's slice: its partial sums, summed over the group
            sums, counts = self.sequence.sum(sums), self.sequence.sum(counts.detach())
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
        """Target tokens per sequence, as ``model_sequence_logps`` counts them (a slice's counts
        summed over its sequence group)."""
        _, valid = batch_targets(batch)
        counts = sum_per_sequence(valid.float(), valid, batch["sequence_index"], num_sequences)[1]
        return self.sequence.sum(counts) if "shift_labels" in batch else counts

    def _adapters_disabled(self) -> ContextManager:
        return self.policy.disable_adapter()  # PEFT: the base weights alone, in place (sharded or not)

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ref = self._reference_logps(batch)
        chosen, rejected = self._logps(model, batch)
        out = pair_losses(self.cfg, chosen, rejected, *(ref if ref is not None else (None, None)))
        # With sequence parallelism every rank of the group computes the same pair losses from the
        # summed log-probs: each takes 1/N of them (the all-reduce's backward sums the N shares).
        loss = out.losses.sum() / num_items / self.sequence.size
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
        return loss, sums / self.sequence.size

    def metrics(self, sums: list[float], count: float) -> dict[str, float]:
        return {name: value / max(count, 1.0) for name, value in zip(self.metric_names, sums, strict=True)}
