"""Raw records -> token arrays -> rows: the steps the cached build (``entry``) and the stream share.

- ``Tokenize``: the tokenizing worker (called on a batch of a shard by ``shards`` for the cache, directly
  on a block by the stream): raw records -> input_ids, a target mask and an error per record.
- ``FATAL`` / ``fatal_error`` / ``raise_if_fatal``: an error that stops the build whatever
  ``data.on_bad_record`` says (e.g. no chat template), carried through the error column.
- ``SKIP_FIX``: the fix a malformed record's message offers under ``data.on_bad_record=error``.
- ``record_values``: the numbers an objective reads from each record (``ObjectiveSpec.fields``),
  carried beside the tokens as a ``values`` column (one float64 per field) and into the rows.
- ``build_rows``: truncate to ``data.max_seq_len``, drop records without a target, pack (or not).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llmft.data.arrays import take_ranges
from llmft.data.pack import pack_arrays
from llmft.data.read import parse_line
from llmft.data.records import BadRecord, kind_of
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from llmft.recipe.schema import DataConfig

SKIP_FIX = "Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
FATAL = "\x00fatal"  # prefix of an error that stops the build whatever data.on_bad_record says


def fatal_error(problem: Problem) -> str:
    """``problem`` as a record's error string (the error column holds strings only)."""
    return FATAL + json.dumps([problem.where, problem.what, problem.fix])


def raise_if_fatal(error: str | None) -> None:
    """Raise the ``UserError`` that ``fatal_error`` encoded in ``error``, if it did."""
    if error is not None and error.startswith(FATAL):
        raise UserError(Problem(*json.loads(error[len(FATAL) :])))


class RecordEncoder(Protocol):
    """What parses and encodes one kind of record (``ObjectiveSpec.record``): an ``Encoder`` (SFT
    records) or a ``kinds.pairs.PairEncoder`` (preference pairs, one item per pair)."""

    def parse(self, value: Any, fields: dict[str, str] | None) -> Any: ...

    def encode_batch(self, records: list[Any]) -> list[Any]: ...


def record_values(value: Any, names: tuple[str, ...]) -> np.ndarray:
    """The record's number under each of ``names``, as float64; ``BadRecord`` naming the field when
    one is missing or not a finite number."""
    out = np.zeros(len(names), dtype=np.float64)
    for k, name in enumerate(names):
        v = value.get(name) if isinstance(value, dict) else None
        if v is None:
            raise BadRecord(f"has no field '{name}' (a number), which the objective reads from every record")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            what = repr(v) if isinstance(v, (int, float)) else kind_of(v)
            raise BadRecord(f"field '{name}' is {what}, not a finite number (the objective reads it as one)")
        out[k] = v
    return out


class Tokenize:
    """A batch of raw records -> input_ids, target mask, error (one list each, one item a record),
    parsed and encoded by ``encoder`` (a ``RecordEncoder``); with ``values`` (the objective's record
    fields) also a ``values`` list: each record's numbers (``record_values``; zeros for a bad record);
    with an encoder that keeps records (``keeps_records``: prompts) also a ``record`` list: each
    record's JSON as uint8 bytes (empty for a bad record)."""

    def __init__(
        self, encoder: RecordEncoder, lines: bool, fields: dict[str, str], values: tuple[str, ...] = ()
    ) -> None:
        self.encoder, self.lines, self.fields, self.values = encoder, lines, fields, values
        self.records = bool(getattr(encoder, "keeps_records", False))

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        n = len(next(iter(batch.values())))
        errors: list[str | None] = [None] * n
        records, at = [], []
        numbers = [np.zeros(len(self.values), np.float64)] * n
        for k in range(n):
            try:
                if self.lines:
                    value = parse_line(batch["json"][k], batch["error"][k])
                else:
                    value = {c: batch[c][k] for c in batch}
                record = self.encoder.parse(value, self.fields)
                if self.values:
                    numbers[k] = record_values(value, self.values)
                records.append(record)
                at.append(k)
            except ValueError as e:  # BadRecord, or a line that is not JSON
                errors[k] = str(e)
        empty_ids, empty_target = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        ids: list[np.ndarray] = [empty_ids] * n
        target: list[np.ndarray] = [empty_target] * n
        extra: dict[str, list] = {"values": numbers} if self.values else {}
        if self.records:
            extra["record"] = [empty_target] * n
        try:
            encoded = self.encoder.encode_batch(records)
        except UserError as e:  # e.g. no chat template: stops the build, whatever data.on_bad_record says
            return {"input_ids": ids, "target": target, "error": [fatal_error(e.problems[0])] * n, **extra}
        for k, ex in zip(at, encoded, strict=True):
            if isinstance(ex, BadRecord):
                errors[k] = str(ex)
            else:
                ids[k] = np.asarray(ex.input_ids, dtype=np.int32)
                target[k] = ex.target_mask()
                if self.records:
                    extra["record"][k] = np.frombuffer(ex.record, dtype=np.uint8)
        return {"input_ids": ids, "target": target, "error": errors, **extra}


def kept_tokens(
    ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, starts: np.ndarray, kept_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of the kept records (``kept_len`` tokens from each of ``starts``), in that order:
    ``ids[ranges(starts, kept_len)]``, gathered a block at a time (``take_ranges``), or the arrays
    themselves when every token of every record is kept in file order."""
    if len(starts) == len(offsets) - 1 and np.array_equal(kept_len, np.diff(offsets)):
        return ids, target  # every token of every record, in file order: nothing to copy
    return take_ranges((ids, target), starts, kept_len)


def prefix_counts(mask: np.ndarray, at: np.ndarray, block: int = 1 << 20) -> np.ndarray:
    """``concatenate([[0], cumsum(mask)])[at]`` for a 0/1 uint8 mask, one block of tokens at a time:
    no int64 copy of the whole mask (8 bytes a token), and numpy sums int64 ~8x faster than it
    sums uint8 into int64."""
    order = np.argsort(at, kind="stable")
    where = at[order]
    out = np.zeros(len(at), dtype=np.int64)
    running, lo = 0, int(np.searchsorted(where, 0, side="right"))  # position 0: count 0
    for b in range(0, len(mask), block):
        part = np.zeros(min(block, len(mask) - b) + 1, dtype=np.int64)
        np.cumsum(mask[b : b + block].astype(np.int64), out=part[1:])
        hi = int(np.searchsorted(where, b + len(part) - 1, side="right"))
        out[order[lo:hi]] = running + part[where[lo:hi] - b]
        running += int(part[-1])
        lo = hi
    return out


def build_rows(
    ids: np.ndarray,
    target: np.ndarray,
    offsets: np.ndarray,
    items: np.ndarray,
    cfg: DataConfig,
    pad_id: int,
    key: str,
    values: dict[str, np.ndarray] | None = None,
) -> tuple[TokenDataset, dict]:
    """Truncate ``items`` to max_seq_len, drop those without a target, then pack (or not).

    ``values`` (a record field's number per record, by field name) follow their records into the
    rows: one per unpacked row, one per segment of a packed row (0 for a padded tail)."""
    starts, lengths = offsets[items], offsets[items + 1] - offsets[items]
    kept_len = np.minimum(lengths, cfg.max_seq_len)
    truncated = int((lengths > cfg.max_seq_len).sum())
    # Targets at positions 1 .. kept_len-1 (labels[0] is never predicted), from a running count.
    first, end = np.minimum(starts + 1, starts + kept_len), starts + kept_len
    counts = prefix_counts(target, np.concatenate([first, end]))
    targets = counts[len(first) :] - counts[: len(first)]
    keep = targets > 0
    dropped = int((~keep).sum())
    if not keep.any():
        raise UserError(
            Problem(
                key,
                f"no record keeps a target token within data.max_seq_len={cfg.max_seq_len}",
                "Raise data.max_seq_len or shorten the prompts.",
            )
        )
    starts, kept_len = starts[keep], kept_len[keep]
    kept = {name: np.asarray(v, dtype=np.float64)[items][keep] for name, v in (values or {}).items()}
    if cfg.packing:
        packed = pack_arrays(ids, target, starts, kept_len, cfg.max_seq_len, pad_id)
        num_rows = len(packed.segment_offsets) - 1
        row_offsets = np.arange(num_rows + 1, dtype=np.int64) * cfg.max_seq_len
        at, tail = np.maximum(packed.segment_items, 0), packed.segment_items < 0
        per_segment = {name: np.where(tail, 0.0, v[at]) if len(v) else v for name, v in kept.items()}
        rows = TokenDataset.from_arrays(
            packed.input_ids, packed.target, row_offsets, packed.segments, packed.segment_offsets, per_segment
        )
    else:
        row_offsets = np.concatenate([[0], np.cumsum(kept_len)]).astype(np.int64)
        tokens = kept_tokens(ids, target, offsets, starts, kept_len)
        rows = TokenDataset.from_arrays(*tokens, row_offsets, fields=kept)
    stats = {
        "records": len(items),
        "truncated": truncated,
        "dropped_no_targets": dropped,
        "examples": int(keep.sum()),
        "tokens": int(kept_len.sum()),
        "target_tokens": int(targets[keep].sum()),
        "rows": len(rows),
    }
    if cfg.packing:
        stats["packed_rows"] = len(rows)
        stats["packing_efficiency"] = stats["tokens"] / (len(rows) * cfg.max_seq_len)
    return rows, stats
