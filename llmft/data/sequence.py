"""Sequence parallelism: each rank of a sequence group takes its own slice of the group's micro-batch.

Every rank of a group draws the same micro-batch (the sampler is given the group's index as its
data-parallel rank, ``ParallelLayout.dp_rank``) and keeps the contiguous slice
``[sp_rank * T/N, (sp_rank + 1) * T/N)`` of its tokens (``T`` padded up to a multiple of ``N``).
Three things are fixed before slicing, because after it no rank can see them:

- the targets are shifted first (``shift_labels[t]`` is the label of token ``t + 1``), so the last
  token of a slice keeps its target, which sits in the next rank's slice;
- position ids are the whole row's (packed rows restart at every sequence start), so rotary
  embeddings and the packed-row boundaries the attention rebuilds after its all-to-all are right;
- the pad that makes ``T`` divisible carries no target and sits after every real token, so causal
  attention never lets a real token see it;
- a pair batch's ``sequence_last`` marks each sequence's last token (a reward model's score is
  read there), which sits in one slice only.

Each target token is in exactly one slice, so the world all-reduce of the slices' counts is the
global batch's count, counted once (a slice with no target token counts 0: normal).

DeepSpeed's ``UlyssesSPDataLoaderAdapter`` does the same slicing, but it gathers one batch from
each rank of the group and hands them out over N micro-steps: the group would train on its ranks'
different samples one after the other, which breaks llmft's sampler (a group draws one share of
the global batch) and the per-step target count (counted before the first backward). So llmft
slices here, and ``tests/distributed/sp_probe.py`` checks the slices equal the adapter's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from llmft.data.arrays import IGNORE_INDEX, TOKEN_MASK

if TYPE_CHECKING:
    from llmft.plan.layout import ParallelLayout

# Per-token tensors besides input_ids / labels / position_ids that a slice keeps its part of
# (a preference batch's sequence_index: -1 on padding).
_PER_TOKEN_PAD = {"sequence_index": -1}
# A row batch's own tensors; any other of the batch's shape is a record field, sliced with pad 0.
_ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def positions(batch: dict[str, Any]) -> torch.Tensor:
    """The row's position ids: packed rows carry theirs; right-padded rows count from 0."""
    if "position_ids" in batch:
        return batch["position_ids"]
    rows, width = batch["input_ids"].shape
    return torch.arange(width).expand(rows, width)


def sequence_slice(batch: dict[str, Any], sp_rank: int, sp: int) -> dict[str, Any]:
    """This rank's slice of a collated micro-batch (module docstring). Returns ``input_ids``,
    ``position_ids``, ``shift_labels``, the other per-token tensors (record fields included; for pairs,
    ``sequence_last``) sliced; ``attention_mask`` is dropped (right padding never reaches a real
    token under causal attention) and kept, sliced, as ``token_mask`` (what counts tokens); other values (a preference batch's ``num_pairs``,
    ``reference_logps``) are kept whole."""
    ids = batch["input_ids"]
    width = ids.shape[1]
    padded = -(-width // sp) * sp
    extra = padded - width
    pos = positions(batch)
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    if "sequence_index" in batch:  # a packed preference row: a sequence's last token predicts nothing
        seq = batch["sequence_index"]
        targets[:, :-1] = targets[:, :-1].masked_fill(seq[:, :-1] != seq[:, 1:], IGNORE_INDEX)
    whole = {
        "input_ids": F.pad(ids, (0, extra), value=0),
        # The pad continues the last sequence's positions: it is a tail no real token attends to.
        "position_ids": torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1)], dim=1),
        "shift_labels": F.pad(targets, (0, extra), value=IGNORE_INDEX),
    }
    for key, fill in _PER_TOKEN_PAD.items():
        if key in batch:
            whole[key] = F.pad(batch[key], (0, extra), value=fill)
    # Which of the slice's tokens are the batch's (a packed row's are all its own): what counts tokens
    # (a router's load) leaves out the padding and the tail added to divide the row.
    mask = batch.get("attention_mask", batch.get(TOKEN_MASK))
    whole[TOKEN_MASK] = F.pad(torch.ones_like(ids) if mask is None else mask, (0, extra), value=0)
    if "sequence_index" not in batch:  # rows of records: their fields (ObjectiveSpec.fields) are per token
        for key, v in batch.items():
            if key not in _ROW_KEYS and isinstance(v, torch.Tensor) and v.shape == ids.shape:
                whole[key] = F.pad(v, (0, extra), value=0)
    if "sequence_index" in batch:  # where each sequence ends: a score head reads its last token
        seq = batch["sequence_index"]
        ends = (seq >= 0) & (seq != F.pad(seq[:, 1:], (0, 1), value=-1))
        whole["sequence_last"] = F.pad(ends, (0, extra), value=False)
    chunk = padded // sp
    out = {k: v[:, sp_rank * chunk : (sp_rank + 1) * chunk].contiguous() for k, v in whole.items()}
    skip = {"input_ids", "labels", "attention_mask", "position_ids", *_PER_TOKEN_PAD}
    out.update({k: v for k, v in batch.items() if k not in skip and k not in whole})
    return out


def rank_slice(batch: dict[str, Any], layout: ParallelLayout, rank: int) -> dict[str, Any]:
    """What global ``rank`` computes of its group's micro-batch: its slice under sequence
    parallelism (``sequence_slice``), the batch itself without. Every caller (training, eval, the
    reference pass) takes its batch through here."""
    if layout.sp == 1:
        return batch
    return sequence_slice(batch, layout.sp_rank(rank), layout.sp)


def count_slice_targets(batch: dict[str, Any]) -> int:
    """Target tokens of a slice: each global target token is in exactly one slice."""
    return int((batch["shift_labels"] != IGNORE_INDEX).sum())
