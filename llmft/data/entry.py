"""Building one cache entry: tokenize a source's records in worker processes, hold out, make rows, write.

``build_entry`` runs inside ``cache.get_or_build`` in the one process that builds the entry: the
records (``read.Chunk`` s) go through ``rows.Tokenize`` in shards, in up to ``data.num_proc``
worker processes (``shards.tokenize_shards``: finished shards outlive a stopped build); malformed records stop the build or are skipped (``data.on_bad_record``);
a seeded ``data.eval_fraction`` is held out; ``rows.build_rows`` truncates and packs; the rows,
the held-out rows and the eval prompts are written into the entry's build directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmft import stop
from llmft.data.kinds import kind_code
from llmft.data.read import Chunk, parse_line
from llmft.data.rows import SKIP_FIX, Tokenize, raise_if_fatal
from llmft.data.shards import tokenize_shards
from llmft.data.sources import Source
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError
from llmft.plan.kinds import kind_spec
from llmft.plan.objectives import DEFAULT_OBJECTIVE, ObjectiveSpec, objective_spec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmft.recipe.schema import DataConfig


def _num_proc(cfg: DataConfig) -> int:
    """Worker processes asked for; ``shards`` uses no more than there are shards to tokenize."""
    return cfg.num_proc or len(os.sched_getaffinity(0))


def build_entry(
    src: Source,
    chunks: list[Chunk],
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_on: str,
    holdout: float,
    seed: int,
    eval_role: bool,
    tmp: Path,
    shards: Path,
    objective: ObjectiveSpec | None = None,
    fields: tuple[str, ...] = (),
    room: int | None = None,
) -> dict[str, Any]:
    """Write ``src``'s entry into ``tmp``, tokenizing into (or reusing the finished shards in) ``shards``;
    ``objective``'s record kind (default: SFT's) parses, encodes and makes the rows; ``fields`` are the
    record fields (``ObjectiveSpec.fields``) stored with each record; ``room`` is the most tokens a
    record may have besides ``data.max_seq_len`` (``KindCode.room``: a prompt's)."""
    objective = objective or objective_spec(DEFAULT_OBJECTIVE)
    kind, code = kind_spec(objective.record), kind_code(objective.record)
    encoder = code.encoder(tokenizer, train_on, objective, cfg.max_seq_len, room)
    chunks = [c for c in chunks if len(c.dataset)]
    procs = _num_proc(cfg)
    tokenizers = [Tokenize(encoder, c.lines, src.fields, fields) for c in chunks]
    tokenized = tokenize_shards(chunks, tokenizers, shards, procs, src.key)
    bad, errors = _errors(tokenized)
    ids, target, offsets = _flat(tokenized)
    values = _values(tokenized, fields)
    records = _records(tokenized) if kind.keeps_records else None
    for e in errors:
        raise_if_fatal(e)
    locate = _Locate(chunks)
    if len(bad) and cfg.on_bad_record == "error":
        raise UserError(Problem(locate(int(bad[0])), errors[0], SKIP_FIX))
    items = np.setdiff1d(np.arange(len(offsets) - 1, dtype=np.int64), bad, assume_unique=True)
    if len(items) == 0:
        why = f" usable ({len(bad)} malformed, skipped)" if len(bad) else ""
        raise UserError(
            Problem(
                src.key, f"'{src.path}' holds no{why} records", f"Point {src.key} at data with at least one record."
            )
        )
    held_items = None
    if holdout > 0:
        items, held_items = _holdout(items, holdout, seed, src.key)
    meta: dict[str, Any] = {"skipped": f"{locate(int(bad[0]))}: {errors[0]}" if len(bad) else None}
    pad = tokenizer.pad_token_id
    rows, meta["stats"] = code.rows(ids, target, offsets, items, cfg, pad, src.key, values, records, False)
    meta["stats"]["skipped"] = len(bad)
    rows.write(tmp / "rows.arrow")
    prompt_items = items if eval_role else held_items
    if held_items is not None:
        held, meta["held_stats"] = code.rows(
            ids, target, offsets, held_items, cfg, pad, src.key, values, records, False
        )
        meta["held_stats"]["skipped"] = 0
        held.write(tmp / "held.arrow")
    # Exact-match eval prompts need a reference completion (prompt records have none).
    some = prompt_items is not None and kind.eval_prompts
    prompts = _eval_prompts(chunks, prompt_items, encoder, src, cfg) if some else []
    write_prompts(tmp, prompts)
    return meta


def write_prompts(entry: Path, prompts: list[tuple[np.ndarray, str]]) -> None:
    """Eval prompts as ``prompts.arrow`` (their ids, a ``TokenDataset`` that ranks map like rows: no
    Python object per token) and ``prompts.json`` (their reference texts)."""
    lengths = np.array([len(p) for p, _ in prompts], dtype=np.int64)
    ids = np.concatenate([np.asarray(p, dtype=np.int32) for p, _ in prompts]) if prompts else np.zeros(0, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    TokenDataset.from_arrays(ids, np.zeros(len(ids), np.uint8), offsets).write(entry / "prompts.arrow")
    (entry / "prompts.json").write_text(json.dumps([ref for _, ref in prompts]))


def read_prompts(entry: Path) -> list[tuple[np.ndarray, str]]:
    """``write_prompts``' prompts: each prompt's ids a view of the mapped ``prompts.arrow``."""
    rows, refs = TokenDataset.open(entry / "prompts.arrow"), json.loads((entry / "prompts.json").read_text())
    assert len(rows) == len(refs), f"{entry}: {len(rows)} prompts, {len(refs)} references"
    return [(rows[i]["input_ids"], ref) for i, ref in enumerate(refs)]


def _records(tokenized: list) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt record's JSON bytes (the ``record`` column ``Tokenize`` wrote), as offsets and bytes."""
    import pyarrow as pa  # only the building process: a rank that reads rows stays without it

    pieces = [chunk for t in tokenized for chunk in t.column("record").chunks]
    arr = pa.concat_arrays(pieces) if pieces else pa.array([], type=pa.large_list(pa.uint8()))
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)[int(offsets[0]) :] if len(arr.values) else np.zeros(0)
    return (offsets - offsets[0]).astype(np.int64), values.astype(np.uint8, copy=False)


def _values(tokenized: list, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each record field's number per record (the ``values`` column ``Tokenize`` wrote: one float64 per field)."""
    if not names:
        return {}
    import pyarrow as pa  # only the building process: a rank that reads rows stays without it

    pieces = [chunk for t in tokenized for chunk in t.column("values").chunks]
    arr = pa.concat_arrays(pieces) if pieces else pa.array([], type=pa.large_list(pa.float64()))
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(len(arr), len(names))
    return {name: flat[:, k] for k, name in enumerate(names)}


def _errors(tokenized: list) -> tuple[np.ndarray, list[str]]:
    """The indices of the records that have an error, and those errors (no per-record Python list)."""
    import pyarrow as pa  # only the building process: a rank that reads rows stays without it

    column = pa.chunked_array([c for t in tokenized for c in t.column("error").chunks], type=pa.string())
    bad = np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False)).astype(np.int64)
    return bad, column.take(pa.array(bad)).to_pylist()


def _flat(tokenized: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All chunks' input_ids and target masks as flat arrays with record offsets."""
    import pyarrow as pa  # only the building process: a rank that reads rows stays without it

    def column(name: str) -> tuple[np.ndarray, np.ndarray]:
        pieces = [chunk for t in tokenized for chunk in t.column(name).chunks]
        arr = pa.concat_arrays(pieces) if pieces else pa.array([], type=pa.list_(pa.int32()))
        arr = arr.cast(pa.large_list(arr.type.value_type))
        offsets = arr.offsets.to_numpy()
        values = arr.values.to_numpy()[int(offsets[0]) :] if len(arr.values) else np.zeros(0)
        return (offsets - offsets[0]).astype(np.int64), values

    offsets, ids = column("input_ids")
    _, target = column("target")
    return ids.astype(np.int32, copy=False), target.astype(np.uint8, copy=False), offsets


class _Locate:
    """Record index over all chunks -> its location."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self.chunks = chunks
        self.starts = np.cumsum([0] + [len(c.dataset) for c in chunks])

    def record(self, i: int) -> tuple[Chunk, int]:
        c = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.chunks[c], i - int(self.starts[c])

    def __call__(self, i: int) -> str:
        chunk, row = self.record(i)
        if chunk.lines:
            raw = chunk.dataset[row]
            return chunk.locator.where(row, raw["file"], raw["pos"])
        return chunk.locator.where(row)


def _holdout(items: np.ndarray, fraction: float, seed: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random ``fraction`` of the records for eval; both parts keep file order."""
    num_eval = max(1, round(fraction * len(items)))
    if num_eval >= len(items):
        raise UserError(
            Problem(
                "data.eval_fraction",
                f"{fraction} of {len(items)} records of {key} leaves nothing to train on",
                "Lower data.eval_fraction, add records, or set data.eval.",
            )
        )
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).numpy()
    held = np.zeros(len(items), dtype=bool)
    held[perm[:num_eval]] = True
    return items[~held], items[held]


def _eval_prompts(chunks: list[Chunk], items: np.ndarray, encoder: Any, src: Source, cfg: DataConfig) -> list:
    """(prompt ids, reference) of the eval records that have a prompt shorter than max_seq_len."""
    locate, out = _Locate(chunks), []
    for i in items.tolist():
        stop.check()  # a prompt is one render of the chat template: a slow one must not hold a stop
        chunk, row = locate.record(i)
        raw = chunk.dataset[row]
        value = parse_line(raw["json"], raw["error"]) if chunk.lines else raw
        prompt = encoder.eval_prompt(encoder.parse(value, src.fields))
        # A prompt must leave room to generate at least one token within the context.
        if prompt is not None and len(prompt[0]) < cfg.max_seq_len:
            out.append(prompt)
    return out
