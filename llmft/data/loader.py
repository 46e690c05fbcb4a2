"""Micro-batches as tensors: padding, the attention inputs, and counting target tokens."""

from __future__ import annotations

import functools
from typing import Any

import torch

from llmft.data.encode import IGNORE_INDEX
from llmft.data.pairs import collate_pairs
from llmft.data.prompts import collate_prompts
from llmft.data.sampler import MicroBatchSampler
from llmft.data.sequence import count_slice_targets
from llmft.data.workers import StopSafeDataLoader, ignore_stop_signals


def collate(examples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Right-pad a list of dataset rows into a batch.

    Unpacked rows get an ``attention_mask``. Packed rows get ``position_ids``
    and deliberately no ``attention_mask``: transformers builds the
    block-diagonal mask from the restarting positions only when the 2D mask
    is absent (see ``llmft.data.pack``). Pads are marked by position, never by
    ``input_ids == pad_id``, so a pad id equal to eos is harmless.

    Rows are arrays (``TokenDataset`` items; lists work too) copied into the batch's int64 tensors
    through numpy views of them: no Python object per token, whatever the row's length.

    Record fields (``ObjectiveSpec.fields``, an item's ``fields``) become one float32 tensor each,
    ``batch[name]`` of the batch's shape: each token its record's number, 0 on padding.

    Preference pairs (items of a ``pairs.PairDataset``) go to ``pairs.collate_pairs``, prompts (items
    that carry their ``record``) to ``prompts.collate_prompts``.
    """
    if "chosen" in examples[0]:
        return collate_pairs(examples, pad_id)
    if "record" in examples[0]:
        return collate_prompts(examples, pad_id)
    packed = examples[0]["position_ids"] is not None
    assert all((e["position_ids"] is not None) == packed for e in examples), "mixed packed and unpacked rows"
    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    extra = torch.zeros((len(examples), width), dtype=torch.long)  # attention_mask or position_ids
    ids_np, labels_np, extra_np = input_ids.numpy(), labels.numpy(), extra.numpy()  # views: writes land in the tensors
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids_np[row, :n] = e["input_ids"]
        labels_np[row, :n] = e["labels"]
        if packed:
            extra_np[row, :n] = e["position_ids"]
            extra[row, n:] = torch.arange(width - n)  # a padded tail is its own (ignored) sequence
        else:
            extra[row, :n] = 1
    key = "position_ids" if packed else "attention_mask"
    batch = {"input_ids": input_ids, "labels": labels, key: extra}
    for name in examples[0].get("fields", ()):
        values = torch.zeros((len(examples), width), dtype=torch.float32)
        for row, e in enumerate(examples):
            values.numpy()[row, : len(e["input_ids"])] = e["fields"][name]
        batch[name] = values
    return batch


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that contribute to the causal LM loss (HF shifts labels by one inside the loss)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def batch_targets(batch: dict[str, Any]) -> int:
    """Target tokens of a micro-batch, or of this rank's sequence slice of one (``data.sequence``)."""
    return count_slice_targets(batch) if "shift_labels" in batch else count_targets(batch["labels"])


def make_loader(
    dataset: Any, sampler: MicroBatchSampler, pad_id: int, num_workers: int, prefetch_factor: int
) -> torch.utils.data.DataLoader:
    """A DataLoader over ``sampler``'s micro-batches; workers stay alive across the (endless) iteration
    and leave the stop signals to the training process (``llmft.data.workers``)."""
    workers = num_workers > 0
    return StopSafeDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, pad_id=pad_id),
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if workers else None,
        persistent_workers=workers,
        worker_init_fn=ignore_stop_signals if workers else None,
        pin_memory=torch.cuda.is_available(),
    )
