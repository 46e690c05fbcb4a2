"""SFT records (the ``sequences`` kind: ``train.objective: sft`` and objectives like it): one row per
record, or several records per row with ``data.packing``; record fields ride along per token.

Parsing and tokenizing are ``encode.Encoder``'s, truncation and packing ``rows.build_rows``';
this module is the kind's code (``kinds.KindCode``) and its micro-batches (``collate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmft.data.arrays import IGNORE_INDEX, TOKEN_MASK
from llmft.data.encode import Encoder
from llmft.data.rows import build_rows
from llmft.data.tokens import TokenDataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmft.recipe.schema import DataConfig, Recipe


def encoder(
    tokenizer: PreTrainedTokenizerBase, train_on: str, objective: Any, max_tokens: int | None, room: int | None
) -> Encoder:
    """SFT records are cut to ``max_tokens`` before tokenizing (the per-record memory bound)."""
    return Encoder(tokenizer, train_on, max_tokens)


def room(recipe: Recipe) -> None:
    return None


def rows(
    ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, items: np.ndarray, cfg: DataConfig, pad_id: int,
    key: str, values: dict | None, records: tuple | None, block: bool = False,
) -> tuple[TokenDataset | None, dict]:  # fmt: skip
    """``rows.build_rows``; a stream block none of whose records keeps a target is no rows (None)."""
    if block and not _any_target(target, offsets, items, cfg.max_seq_len):
        return None, {}
    return build_rows(ids, target, offsets, items, cfg, pad_id, key, values)


def _any_target(target: np.ndarray, offsets: np.ndarray, items: np.ndarray, max_len: int) -> bool:
    for i in items.tolist():
        lo = int(offsets[i])
        if target[lo + 1 : lo + min(max_len, int(offsets[i + 1]) - lo)].any():
            return True
    return False


def empty(cfg: DataConfig) -> TokenDataset:
    return TokenDataset.empty()


def open(rows: TokenDataset, cfg: DataConfig, path: Path | None = None) -> TokenDataset:  # noqa: A001
    return rows


def owns(item: dict[str, Any]) -> bool:
    return "input_ids" in item and "labels" in item


def totals(stats: dict, cfg: DataConfig) -> None:
    if cfg.packing:
        stats["packed_rows"] = stats["rows"]
        stats["packing_efficiency"] = stats["tokens"] / max(1, stats["rows"] * cfg.max_seq_len)


def describe(s: dict) -> str:
    return (
        f"{s['records']:,} records -> {s['examples']:,} examples, {s['tokens']:,} tokens "
        f"({s['target_tokens']:,} targets), {s['rows']:,} rows"
    )


def collate(examples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Right-pad a list of dataset rows into a batch.

    Unpacked rows get an ``attention_mask``. Packed rows get ``position_ids``
    and deliberately no ``attention_mask``: transformers builds the
    block-diagonal mask from the restarting positions only when the 2D mask
    is absent (see ``llmft.data.pack``). Pads are marked by position, never by
    ``input_ids == pad_id``, so a pad id equal to eos is harmless; a packed batch's ``token_mask``
    marks the rows' own tokens (1) against the padded tail (0), for what counts tokens (a router's
    load), never for the model.

    Rows are arrays (``TokenDataset`` items; lists work too) copied into the batch's int64 tensors
    through numpy views of them: no Python object per token, whatever the row's length.

    Record fields (``ObjectiveSpec.fields``, an item's ``fields``) become one float32 tensor each,
    ``batch[name]`` of the batch's shape: each token its record's number, 0 on padding.
    """
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
    if packed:  # which tokens are the rows' (not the padded tail), for what counts tokens: a router's load
        lengths = torch.tensor([len(e["input_ids"]) for e in examples])
        batch[TOKEN_MASK] = (torch.arange(width) < lengths[:, None]).long()
    for name in examples[0].get("fields", ()):
        values = torch.zeros((len(examples), width), dtype=torch.float32)
        for row, e in enumerate(examples):
            values.numpy()[row, : len(e["input_ids"])] = e["fields"][name]
        batch[name] = values
    return batch
