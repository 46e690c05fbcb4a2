"""From ``data.*`` keys to token datasets: read, validate, tokenize, hold out, truncate, pack.

Everything is tokenized once, up front, in the main process, one record at a
time (no progress bar, no parallel tokenizer threads before DataLoader
workers fork). That is fine for fine-tuning-sized data; for millions of
records this is the place to add a cached, memory-mapped token store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from llmft.data.encode import IGNORE_INDEX, Encoder, Example
from llmft.data.pack import pack
from llmft.data.read import describe, read_records
from llmft.data.records import BadRecord, Record, parse_record
from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmft.recipe.schema import DataConfig, Recipe

log = logging.getLogger("llmft.data")

SKIP_FIX = "Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
Row = tuple[list[int], list[int], "list[int] | None"]


class TokenDataset:
    """Rows of token ids, labels and (packed rows only) position ids.

    Stored as flat numpy arrays plus offsets rather than lists of Python ints:
    compact, and DataLoader workers forked from the trainer share the pages
    instead of copying them on every refcount change.
    """

    def __init__(self, rows: list[Row]) -> None:
        lengths = np.array([len(ids) for ids, _, _ in rows], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._input_ids = _flat([ids for ids, _, _ in rows])
        self._labels = _flat([labels for _, labels, _ in rows])
        self.packed = bool(rows) and rows[0][2] is not None
        self._positions = _flat([pos for _, _, pos in rows]) if self.packed else None

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        lo, hi = self._offsets[i], self._offsets[i + 1]
        return {
            "input_ids": self._input_ids[lo:hi].tolist(),
            "labels": self._labels[lo:hi].tolist(),
            "position_ids": self._positions[lo:hi].tolist() if self._positions is not None else None,
        }


def _flat(seqs: list[list[int]]) -> np.ndarray:
    return np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=sum(map(len, seqs)))


@dataclass
class DataBundle:
    train: TokenDataset
    eval: TokenDataset | None
    eval_prompts: list[tuple[list[int], str]]  # (prompt ids incl. chat template, reference completion)
    stats: dict = field(default_factory=dict)  # train counts at the top level, eval counts under "eval"


@dataclass
class _Item:
    where: str
    record: Record
    example: Example


def build_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> DataBundle:
    """Train (and eval) datasets as the training loop consumes them; ``data.eval`` or a seeded holdout."""
    cfg = recipe.data
    encoder = Encoder(tokenizer, cfg.train_on)
    train, train_skipped = _encode_source(cfg.train, "data.train", encoder, cfg)
    eval_items: list[_Item] | None = None
    eval_skipped = 0
    if cfg.eval is not None:
        eval_items, eval_skipped = _encode_source(cfg.eval, "data.eval", encoder, cfg)
    elif cfg.eval_fraction > 0:
        train, eval_items = _holdout(train, cfg.eval_fraction, recipe.run.seed)

    train_ds, stats = _to_dataset(train, "data.train", cfg, tokenizer.pad_token_id)
    stats["skipped"] = train_skipped
    eval_ds, eval_prompts = None, []
    if eval_items is not None:
        eval_ds, stats["eval"] = _to_dataset(eval_items, "data.eval", cfg, tokenizer.pad_token_id)
        stats["eval"]["skipped"] = eval_skipped
        prompts = (encoder.eval_prompt(item.record) for item in eval_items)
        # A prompt must leave room to generate at least one token within the context.
        eval_prompts = [p for p in prompts if p is not None and len(p[0]) < cfg.max_seq_len]
        stats["eval"]["prompts"] = len(eval_prompts)
    return DataBundle(train_ds, eval_ds, eval_prompts, stats)


def _encode_source(source: Any, key: str, encoder: Encoder, cfg: DataConfig) -> tuple[list[_Item], int]:
    """Read, validate and tokenize every record; bad ones raise or are skipped and counted."""
    items, skipped = [], []
    for raw in read_records(source, key):
        try:
            if raw.error is not None:
                raise BadRecord(raw.error)
            record = parse_record(raw.value)
            items.append(_Item(raw.where, record, encoder.encode(record)))
        except BadRecord as e:
            if cfg.on_bad_record == "error":
                raise UserError(Problem(raw.where, str(e), SKIP_FIX)) from None
            skipped.append(f"{raw.where}: {e}")
    if skipped:
        log.warning(
            "%s: skipped %d malformed record(s) (data.on_bad_record=skip); the first: %s", key, len(skipped), skipped[0]
        )
    if not items:
        why = f" usable ({len(skipped)} malformed, skipped)" if skipped else ""
        raise UserError(
            Problem(
                key, f"'{describe(source)}' holds no{why} records", f"Point {key} at data with at least one record."
            )
        )
    return items, len(skipped)


def _holdout(items: list[_Item], fraction: float, seed: int) -> tuple[list[_Item], list[_Item]]:
    """A seeded random ``fraction`` of the records for eval; both parts keep file order."""
    import torch

    num_eval = max(1, round(fraction * len(items)))
    if num_eval >= len(items):
        raise UserError(
            Problem(
                "data.eval_fraction",
                f"{fraction} of {len(items)} records leaves nothing to train on",
                "Lower data.eval_fraction, add records, or set data.eval.",
            )
        )
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(perm[:num_eval])
    train = [item for i, item in enumerate(items) if i not in held]
    return train, [items[i] for i in sorted(held)]


def _to_dataset(items: list[_Item], key: str, cfg: DataConfig, pad_id: int) -> tuple[TokenDataset, dict]:
    examples, truncated = [], 0
    for item in items:
        ex = item.example
        if len(ex.input_ids) > cfg.max_seq_len:
            truncated += 1
            ex = Example(ex.input_ids[: cfg.max_seq_len], ex.labels[: cfg.max_seq_len])
        if any(label != IGNORE_INDEX for label in ex.labels[1:]):
            examples.append(ex)
    dropped = len(items) - len(examples)
    _warn_shortened(key, len(items), truncated, dropped, cfg.max_seq_len)
    if not examples:
        raise UserError(
            Problem(
                key,
                f"no record keeps a target token within data.max_seq_len={cfg.max_seq_len}",
                "Raise data.max_seq_len or shorten the prompts.",
            )
        )
    if cfg.packing:
        rows: list[Row] = list(pack(examples, cfg.max_seq_len, pad_id))
    else:
        rows = [(ex.input_ids, ex.labels, None) for ex in examples]
    stats = _stats(items, examples, truncated, dropped, len(rows), cfg)
    log.info("%s: %s", key, ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.1%}" for k, v in stats.items()))
    return TokenDataset(rows), stats


def _warn_shortened(key: str, total: int, truncated: int, dropped: int, max_seq_len: int) -> None:
    if truncated:
        log.warning("%s: truncated %d of %d records to data.max_seq_len=%d tokens", key, truncated, total, max_seq_len)
    if dropped:
        log.warning("%s: dropped %d of %d records with no target token left after truncation", key, dropped, total)


def _stats(
    items: list[_Item], examples: list[Example], truncated: int, dropped: int, rows: int, cfg: DataConfig
) -> dict:
    tokens = sum(len(ex.input_ids) for ex in examples)
    stats = {
        "records": len(items),
        "truncated": truncated,
        "dropped_no_targets": dropped,
        "examples": len(examples),
        "tokens": tokens,
        "target_tokens": sum(sum(label != IGNORE_INDEX for label in ex.labels[1:]) for ex in examples),
        "rows": rows,
    }
    if cfg.packing:
        stats["packed_rows"] = rows
        stats["packing_efficiency"] = tokens / (rows * cfg.max_seq_len)
    return stats
