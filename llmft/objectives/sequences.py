"""Per-sequence sums over any parallel layout: what an objective that scores whole sequences (the
DPO family, reward models, and objectives to come that score completions) needs, written once.

A micro-batch holds sequences: padded rows, or packed rows with ``sequence_index`` naming the
sequence of every token (-1: padding). Under sequence parallelism (``distributed.sequence_parallel``,
``ParallelLayout.sp``) each rank of a sequence group holds a slice of every sequence
(``llmft.data.sequence``: ``shift_labels`` already shifted, ``sequence_last`` marking each
sequence's last token). ``SequenceSlices`` is the one helper for that: ``whole`` sums a per-sequence
tensor over the slices of the group (with gradients: each slice gets the whole sum's gradient),
``count`` counts an item once per group, ``share`` gives each rank its 1/N of a loss every rank of
the group computes alike. An objective's loss is then written once for any layout:

    sums, counts = self.slices.whole(model_sequence_logps(model, batch, n)), ...
    loss = self.slices.share(per_item_losses.sum() / num_items)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce

from llmft.job.dist import sequence_group
from llmft.model import loss as lm_loss
from llmft.model.loss import IGNORE_INDEX
from llmft.objectives import model_inputs
from llmft.plan.layout import ParallelLayout


class SequenceSlices:
    """This rank's place in its sequence group (the layout's ``sp`` dimension); one group of one
    rank (every sequence whole) without sequence parallelism."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.size = layout.sp
        self.group = None
        self.first = True  # holds the first slice: counts the group's items
        if self.size > 1:
            self.group = sequence_group(layout.mesh)
            self.first = torch.distributed.get_rank(self.group) == 0

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence partial sums of this rank's slices, summed over the group (with gradients)."""
        if self.group is None:
            return values
        return all_reduce(values, group=self.group)

    def count(self, items: int) -> int:
        """A group's items counted once (every rank of a group holds the same items)."""
        return items if self.first else 0

    def share(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's share of a value every rank of the group computes alike from whole sums (the
        all-reduce's backward sums the N shares' gradients)."""
        return value / self.size


def is_slice(batch: dict[str, Any]) -> bool:
    """Whether ``batch`` is this rank's slice of its group's micro-batch (``llmft.data.sequence``)."""
    return "shift_labels" in batch


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


def predicted_tokens(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token each position predicts, whether that prediction counts), both ``[R, T]``, of a
    collated pair batch (``predicted_targets``) or of a sequence slice, whose ``shift_labels`` are
    already shifted and cut where a sequence ends (``llmft.data.sequence``)."""
    index = batch["sequence_index"]
    if not is_slice(batch):
        return predicted_targets(batch["labels"], index)
    shift = batch["shift_labels"]
    valid = (shift != IGNORE_INDEX) & (index >= 0)
    return torch.where(valid, shift, 0), valid


def model_sequence_logps(
    model: torch.nn.Module, batch: dict[str, Any], num_sequences: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of target-token log-probs, number of target tokens) per sequence of a collated pair
    batch, from ``model``'s forward. With the chunked head installed (``llmft.model.loss``) the model
    returns the targets' log-probs a chunk at a time and never holds the micro-batch's logits.

    A sequence slice (``shift_labels`` in the batch, ``llmft.data.sequence``): position t predicts
    ``shift_labels[t]``, already shifted and cut where a sequence ends; the sums are this slice's
    part, which the sequence group makes whole (``SequenceSlices.whole``)."""
    index = batch["sequence_index"]
    target, valid = predicted_tokens(batch)
    head = lm_loss.find(model)
    if head is None:
        logits = model(**model_inputs(batch), use_cache=False).logits
        flat = logits.reshape(-1, logits.shape[-1]).float()
        token_logps = -F.cross_entropy(flat, target.reshape(-1), reduction="none").reshape(target.shape)
    else:
        with lm_loss.token_logps(head, target):
            token_logps = model(**model_inputs(batch), use_cache=False).logits
    return sum_per_sequence(token_logps, valid, index, num_sequences)
