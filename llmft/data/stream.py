"""``data.streaming``: read, tokenize and pack ``data.train`` on the fly, resumable from a cursor.

The source is read in *blocks* of ``data.stream_block`` raw records. Each block is tokenized,
truncated and packed (or left padded) by the same code as the cache (``rows.build_rows``), and
its rows are shuffled within the block by a permutation seeded with ``(run.seed, block)``.
The training stream is the concatenation of the blocks' rows, pass after pass over the source
(a block never spans two passes). So row ``p`` of the stream is a pure function of
(seed, position, data), like ``GlobalOrder`` for the cache, and its order is the identity (``sampler.Positions``):
``MicroBatchSampler`` deals positions to ranks and micro-steps exactly as for cached data (G1).

What a checkpoint keeps (``TrainerState.data["stream"]``) is the *cursor* of the block that
holds the next position: the pass, block index, first row, and where that block starts in the
source (JSONL: file, byte offset and line; a ``.json`` file: file and record; Parquet, CSV,
save_to_disk and hub data: the ``datasets.IterableDataset`` state). A resume opens the source
there: JSONL seeks to the byte, other files and shards before the cursor are skipped unread,
records inside the cursor's Parquet/CSV/hub shard are read again (not tokenized), and one block
is tokenized again. The cursor lives in the training process, so a streamed run loads its
micro-batches there (``data.num_workers`` is not used).

Several sources (``data.mixture: probability``) are one ``StreamDataset`` each, dealt positions by
``MixedStream`` with the windows of cached probability mixtures; the checkpoint keeps one cursor
per source.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from llmft.data.kinds import kind_code
from llmft.data.read import (
    LINE_EXTENSIONS,
    Resolved,
    bounded_lines,
    json_rows,
    load_hub,
    load_saved,
    not_utf8,
    resolve,
    too_long,
)
from llmft.data.rows import SKIP_FIX, Tokenize, raise_if_fatal
from llmft.data.sampler import ShareWindows
from llmft.data.sources import Source
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError
from llmft.plan.kinds import kind_spec
from llmft.plan.objectives import DEFAULT_OBJECTIVE, ObjectiveSpec, objective_spec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmft.recipe.schema import DataConfig

log = logging.getLogger("llmft.data")

START = {"pass": 0, "block": 0, "row": 0, "source": None}


class StreamDataset:
    """Rows of the stream by position, read forward from a cursor; one block held in memory."""

    def __init__(self, reader: _Reader, blocks: _Blocks, seed: int, shuffle: bool, block_size: int) -> None:
        self.reader, self.blocks = reader, blocks
        self.seed, self.shuffle, self.block_size = seed, shuffle, block_size
        self.packed = blocks.cfg.packing
        self.stats = {"records": 0, "skipped": 0, "rows": 0, "blocks": 0}
        self.restore(dict(START))

    def restore(self, cursor: dict[str, Any]) -> None:
        """Continue from ``cursor`` (a block start, as ``cursor_at`` returned it)."""
        self._start = dict(cursor)
        self._cursor = dict(cursor)  # of the block held (or, before the first read, of the next one)
        self._rows: TokenDataset | None = None
        self._perm: list[int] = []
        self._reading = False

    def cursor_at(self, position: int) -> dict[str, Any]:
        """The cursor of the block that holds ``position`` (reads ahead to it)."""
        self._seek(position)
        return dict(self._cursor)

    def epoch(self, position: int) -> float:
        """The pass over the source that ``position`` falls in (a whole number: a pass's length is unknown)."""
        return float(self.cursor_at(position)["pass"])

    def __getitem__(self, position: int) -> dict[str, Any]:
        self._seek(position)
        return self._rows[self._perm[position - self._cursor["row"]]]

    def _seek(self, position: int) -> None:
        if position < self._cursor["row"]:  # only backwards after a restore to a later cursor: start over
            if position < self._start["row"]:
                self.restore(dict(START))
            else:
                self.restore(self._start)
        while self._rows is None or position >= self._cursor["row"] + len(self._perm):
            if self._rows is not None:
                self._cursor = {**self._next, "row": self._cursor["row"] + len(self._perm)}
            self._read_block()

    def _read_block(self) -> None:
        """Read the block at ``self._cursor``; leave where the next one starts in ``self._next``."""
        cur = self._cursor
        if not self._reading:
            self.reader.start(cur["source"])
            self._reading = True
            self._pass_rows = 0 if cur["source"] is None else None  # None: the pass began before a restore
        records = []
        for rec in self.reader:
            records.append(rec)
            if len(records) == self.block_size:
                break
        rows, stats = self.blocks.rows(records)
        n = len(rows)
        self.stats["records"] += len(records)
        self.stats["skipped"] += stats["skipped"]
        self.stats["blocks"] += 1
        self.stats["rows"] += n
        if self._pass_rows is not None:
            self._pass_rows += n
        if len(records) < self.block_size or self.reader.exhausted():  # the pass ends with this block
            if self._pass_rows == 0:
                raise UserError(
                    Problem(
                        self.blocks.key,
                        "holds no usable records (none keeps a target token within data.max_seq_len "
                        f"{self.blocks.cfg.max_seq_len})",
                        "Point it at other data, raise data.max_seq_len, or check data.on_bad_record.",
                    )
                )
            self._next = {"pass": cur["pass"] + 1, "block": cur["block"] + 1, "source": None}
            self._reading = False
        else:
            self._next = {"pass": cur["pass"], "block": cur["block"] + 1, "source": self.reader.cursor()}
        self._rows = rows
        if self.shuffle and n > 1:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + cur["block"])
            self._perm = torch.randperm(n, generator=gen).tolist()
        else:
            self._perm = list(range(n))


class MixedStream:
    """``data.mixture: probability`` over streamed sources.

    ``sampler.ShareWindows`` deals every window of positions to the sources by their exact
    shares (as for cached mixtures); the j-th position dealt to source k is row j of that
    source's own stream (a ``StreamDataset`` shuffled with its own seed, pass after pass). Each
    source's rows are asked for in increasing order, so each stream is read forward only. The
    checkpoint keeps one cursor per source: the block holding that source's next sample.
    """

    def __init__(self, streams: list[StreamDataset], probabilities: list[float], seed: int) -> None:
        self.streams = streams
        self.windows = ShareWindows(probabilities, seed)
        self.packed = all(s.packed for s in streams)

    @property
    def stats(self) -> dict[str, int]:
        return {k: sum(s.stats[k] for s in self.streams) for k in self.streams[0].stats}

    def __getitem__(self, position: int) -> dict[str, Any]:
        k, j = self.windows.draw(position)
        return self.streams[k][j]

    def cursor_at(self, position: int) -> list[dict[str, Any]]:
        """Each source's cursor: the block that holds its first sample at or after ``position``."""
        return [s.cursor_at(n) for s, n in zip(self.streams, self.windows.taken(position), strict=True)]

    def restore(self, cursors: list[dict[str, Any]]) -> None:
        for s, c in zip(self.streams, cursors, strict=True):
            s.restore(c)

    def epoch(self, position: int) -> float:
        """The passes every source has begun: the smallest pass among the sources' next samples."""
        return min(float(c["pass"]) for c in self.cursor_at(position))


class _Blocks:
    """Raw records of one block -> rows, by the cache's own tokenizer, truncation and packing (the
    objective's record kind's code: ``kinds.KindCode``)."""

    def __init__(
        self,
        src: Source,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        train_on: str,
        objective: ObjectiveSpec,
        room: int | None = None,
    ) -> None:
        self.key, self.cfg, self.pad_id = src.key, cfg, tokenizer.pad_token_id
        self.kind, self.code = kind_spec(objective.record), kind_code(objective.record)
        names = objective.fields  # the record fields it reads
        self.lines = Tokenize(
            self.code.encoder(tokenizer, train_on, objective, cfg.max_seq_len, room), True, src.fields, names
        )
        self.tables = Tokenize(
            self.code.encoder(tokenizer, train_on, objective, cfg.max_seq_len, room), False, src.fields, names
        )

    def rows(self, records: list[tuple[Any, str | None, str, bool]]) -> tuple[Any, dict]:
        empty = self.code.empty(self.cfg)
        if not records:
            return empty, {"skipped": 0}
        errors: list[str | None] = []
        ids, target, numbers, kept = [], [], [], []
        for lines, group in _runs(records):
            if lines:
                batch = {"json": [r[0] for r in group], "error": [r[1] for r in group]}
                out = self.lines(batch)
            else:
                columns = sorted({c for r in group for c in r[0]})
                out = self.tables({c: [r[0].get(c) for r in group] for c in columns})
            errors += out["error"]
            ids += out["input_ids"]
            target += out["target"]
            numbers += out.get("values", [])
            kept += out.get("record", [])
        for k, e in enumerate(errors):
            raise_if_fatal(e)
            if e is not None and self.cfg.on_bad_record == "error":
                raise UserError(Problem(records[k][2], e, SKIP_FIX))
        items = np.array([k for k, e in enumerate(errors) if e is None], dtype=np.int64)
        skipped = len(records) - len(items)
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat_ids = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
        flat_target = np.concatenate(target).astype(np.uint8) if target else np.zeros(0, np.uint8)
        if len(items) == 0:
            return empty, {"skipped": skipped}
        kept_records = None
        if self.kind.keeps_records:
            rec_offsets = np.concatenate([[0], np.cumsum([len(r) for r in kept])]).astype(np.int64)
            kept_records = (rec_offsets, np.concatenate(kept).astype(np.uint8) if kept else np.zeros(0, np.uint8))
        names = self.lines.values
        values = {name: np.array([v[k] for v in numbers], np.float64) for k, name in enumerate(names)}
        rows, _ = self.code.rows(
            flat_ids, flat_target, offsets, items, self.cfg, self.pad_id, self.key, values, kept_records, True
        )
        return (empty if rows is None else rows), {"skipped": skipped}


def _runs(records: list) -> Iterator[tuple[bool, list]]:
    """Consecutive records of the same kind (raw JSON lines or table rows)."""
    start = 0
    for k in range(1, len(records) + 1):
        if k == len(records) or records[k][3] != records[start][3]:
            yield records[start][3], records[start:k]
            start = k


# --- readers: raw records from a cursor ---------------------------------------------------------


class _Reader:
    """Iterates ``(value, error, where, is_json_text)`` from ``start(cursor)``; ``cursor()`` is the next record."""

    def start(self, cursor: Any) -> None: ...
    def cursor(self) -> Any: ...
    def exhausted(self) -> bool: ...
    def __iter__(self):
        return self

    def __next__(self): ...


class _LineReader(_Reader):
    """JSONL (seek to a byte offset) and JSON (whole file, then its records) files, in order."""

    def __init__(self, files: tuple[Path, ...]) -> None:
        self.files = files

    def start(self, cursor: dict[str, int] | None) -> None:
        self.pos = dict(cursor or {"file": 0, "byte": 0, "line": 0})
        self._it = self._records()
        self._peeked: list = []

    def cursor(self) -> dict[str, int]:
        return dict(self._pos_before_peek) if self._peeked else dict(self.pos)

    def exhausted(self) -> bool:
        if not self._peeked:
            self._pos_before_peek = dict(self.pos)
            self._peeked = [next(self._it, None)]
        return self._peeked[0] is None

    def __next__(self):
        if self._peeked:
            rec = self._peeked.pop()
        else:
            rec = next(self._it, None)
        if rec is None:
            raise StopIteration
        return rec

    def _records(self):
        while self.pos["file"] < len(self.files):
            f = self.pos["file"]
            path = self.files[f]
            if path.suffix == ".jsonl":
                yield from self._jsonl(path, f)
            else:
                for i, text, error in json_rows(path):
                    if i < self.pos["line"]:
                        continue
                    self.pos = {"file": f, "byte": 0, "line": i + 1}
                    yield text, error, f"{path}: record {i}", True
            self.pos = {"file": f + 1, "byte": 0, "line": 0}

    def _jsonl(self, path: Path, f: int):
        byte, line = self.pos["byte"], self.pos["line"]  # where the cursor's line ends, and its number
        with open(path, "rb") as fh:
            fh.seek(byte)
            # A line longer than a record may be is skipped a MiB at a time, never held whole (llmft.limits).
            for k, raw, size in bounded_lines(fh):
                self.pos = {"file": f, "byte": fh.tell(), "line": line + k}
                where = f"{path}:{line + k}"
                if raw is None:
                    yield None, too_long(size), where, True
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield None, not_utf8(e), where, True
                    continue
                if text.strip():
                    yield text, None, where, True


class _IterableReader(_Reader):
    """Parquet / CSV files, save_to_disk dirs and hub datasets as a ``datasets.IterableDataset``."""

    def __init__(self, resolved: Resolved) -> None:
        self.resolved = resolved
        s = resolved.source
        self.name = f"{s.path}[{s.split or 'train'}]" if resolved.kind == "hub" else str(s.path)

    def _dataset(self):
        import datasets  # here, not at the top: only a stream of Parquet/CSV/saved/hub data needs it

        r, s = self.resolved, self.resolved.source
        if r.kind == "hub":
            return load_hub(s, streaming=True)
        if r.kind == "saved":
            return load_saved(r.files[0], s).to_iterable_dataset()
        builder = {".parquet": "parquet", ".csv": "csv"}[r.files[0].suffix]
        return datasets.load_dataset(builder, data_files=[str(p) for p in r.files], split="train", streaming=True)

    def start(self, cursor: dict[str, Any] | None) -> None:
        self.ds = self._dataset()
        self.n = 0
        if cursor is not None:
            self.ds.load_state_dict(cursor["state"])
            self.n = cursor["record"]
        self._it = iter(self.ds)
        self._peeked: list = []

    def cursor(self) -> dict[str, Any]:
        return {"state": self._state, "record": self.n}

    def exhausted(self) -> bool:
        if not self._peeked:
            self._state = self.ds.state_dict()
            self._peeked = [next(self._it, None)]
        return self._peeked[0] is None

    def __next__(self):
        rec = self._peeked.pop() if self._peeked else next(self._it, None)
        if rec is None:
            raise StopIteration
        self.n += 1
        return rec, None, f"{self.name}: record {self.n - 1}", False


def open_stream(
    src: Source,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    objective: ObjectiveSpec | None = None,
    room: int | None = None,
) -> StreamDataset:
    """One source as a stream whose block permutations are seeded with ``seed``; ``objective``'s records
    (default: SFT's; prompt records: at most ``room`` tokens each, ``kinds.prompts.prompt_room``)."""
    objective = objective or objective_spec(DEFAULT_OBJECTIVE)
    resolved = resolve(src)
    if resolved.kind == "files":
        kinds = {p.suffix in LINE_EXTENSIONS for p in resolved.files}
        suffixes = {p.suffix for p in resolved.files}
        if kinds == {True}:
            reader: _Reader = _LineReader(resolved.files)
        elif len(suffixes) == 1:
            reader = _IterableReader(resolved)
        else:
            raise UserError(
                Problem(
                    src.key,
                    f"streams files of different kinds ({', '.join(sorted(suffixes))})",
                    "Convert them to one kind (JSONL streams with exact seeks), or stream one kind.",
                )
            )
    else:
        reader = _IterableReader(resolved)
    blocks = _Blocks(src, cfg, tokenizer, src.train_on or cfg.train_on, objective, room)
    return StreamDataset(reader, blocks, seed, cfg.shuffle, cfg.stream_block)
