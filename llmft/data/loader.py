"""Micro-batches as tensors: padding, the attention inputs, and counting target tokens."""

from __future__ import annotations

import functools
from typing import Any

import torch

from llmft.data.arrays import IGNORE_INDEX
from llmft.data.kinds import kind_code, kind_of_item
from llmft.data.sampler import MicroBatchSampler
from llmft.data.sequence import count_slice_targets
from llmft.data.workers import StopSafeDataLoader, ignore_stop_signals
from llmft.plan.kinds import RecordKind


def collate(examples: list[dict[str, Any]], pad_id: int, kind: RecordKind | str | None = None) -> dict[str, Any]:
    """A micro-batch of dataset items, by their record kind's ``collate`` (``kinds.KindCode``):
    ``kind``, or the kind that owns the items (``kinds.kind_of_item``). SFT rows are right-padded
    (``kinds.sequences.collate``), preference pairs interleaved (``kinds.pairs.collate_pairs``),
    prompts keep their records (``kinds.prompts.collate_prompts``)."""
    return kind_code(kind or kind_of_item(examples[0])).collate(examples, pad_id)


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that contribute to the causal LM loss (HF shifts labels by one inside the loss)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def batch_targets(batch: dict[str, Any]) -> int:
    """Target tokens of a micro-batch, or of this rank's sequence slice of one (``data.sequence``)."""
    return count_slice_targets(batch) if "shift_labels" in batch else count_targets(batch["labels"])


def make_loader(
    dataset: Any,
    sampler: MicroBatchSampler,
    pad_id: int,
    num_workers: int,
    prefetch_factor: int,
    kind: RecordKind | str | None = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader over ``sampler``'s micro-batches; workers stay alive across the (endless) iteration
    and leave the stop signals to the training process (``llmft.data.workers``)."""
    workers = num_workers > 0
    return StopSafeDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, pad_id=pad_id, kind=kind),
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if workers else None,
        persistent_workers=workers,
        worker_init_fn=ignore_stop_signals if workers else None,
        pin_memory=torch.cuda.is_available(),
    )
