"""From ``data.*`` keys to token datasets: read, validate, tokenize, hold out, truncate, pack, cache.

Each source of ``data.train`` / ``data.eval`` becomes one cache entry
(``cache.py``): the first process that needs it reads the records with
``datasets``, tokenizes them with ``Dataset.map(batched=True,
num_proc=data.num_proc)``, holds out ``data.eval_fraction``, truncates, packs,
and writes the rows as an Arrow file; every process then memory-maps that file
(``TokenDataset.open``), so N ranks share one copy of the tokens in the page
cache and a resume, requeue or second run starts without tokenizing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmft.data.cache import CACHE_FORMAT, default_cache_dir, get_or_build, read_meta, size_of, tokenizer_fingerprint
from llmft.data.encode import IGNORE_INDEX, Encoder
from llmft.data.pack import pack_arrays, positions, take_ranges
from llmft.data.read import Chunk, Resolved, parse_line, read, resolve
from llmft.data.records import BadRecord, parse_record
from llmft.data.sampler import GlobalOrder, ProbabilityOrder, largest_remainder, source_seed
from llmft.data.sources import Source, parse_sources
from llmft.data.stream import MixedStream, StreamDataset, StreamOrder, open_stream
from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmft.dist import DistEnv
    from llmft.recipe.schema import DataConfig, Recipe

log = logging.getLogger("llmft.data")

SKIP_FIX = "Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
Row = tuple[list[int], list[int], "list[int] | None"]
_FATAL = "\x00fatal"  # prefix of an error that stops the build whatever data.on_bad_record says
# Below this many records per process, starting worker processes costs more than it saves.
_RECORDS_PER_PROC = 4000


class TokenDataset:
    """Rows of token ids, labels and (packed rows only) position ids, as flat arrays plus offsets.

    Labels are stored as a one-byte target mask (a label is either the token
    itself or IGNORE_INDEX) and position ids as each packed row's sequence
    lengths, so a token costs 5 bytes. ``open`` memory-maps a cache file:
    every process (ranks, DataLoader workers) shares the same pages.
    """

    def __init__(self, rows: list[Row]) -> None:
        lengths = np.array([len(ids) for ids, _, _ in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.array([t for r in rows for t in r[0]], dtype=np.int32)
        labels = np.array([t for r in rows for t in r[1]], dtype=np.int64)
        target = labels != IGNORE_INDEX
        assert (labels[target] == ids[target]).all(), "a label is either its token or IGNORE_INDEX"
        packed = bool(rows) and rows[0][2] is not None
        segments = seg_offsets = None
        if packed:
            segs = [_segments_of(pos) for _, _, pos in rows]
            seg_offsets = np.concatenate([[0], np.cumsum([len(s) for s in segs])]).astype(np.int64)
            segments = np.array([n for s in segs for n in s], dtype=np.int32)
        self._set(ids, target.astype(np.uint8), offsets, segments, seg_offsets)

    @classmethod
    def from_arrays(
        cls,
        input_ids: np.ndarray,
        target: np.ndarray,
        offsets: np.ndarray,
        segments: np.ndarray | None = None,
        segment_offsets: np.ndarray | None = None,
    ) -> TokenDataset:
        self = cls.__new__(cls)
        self._set(input_ids, target, offsets, segments, segment_offsets)
        return self

    def _set(self, ids, target, offsets, segments, seg_offsets) -> None:
        self._input_ids, self._target, self._offsets = ids, target, offsets
        self._segments, self._seg_offsets = segments, seg_offsets
        self.packed = segments is not None
        self.path: Path | None = None

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        ids = self._input_ids[lo:hi]
        item = {
            "input_ids": ids.tolist(),
            "labels": np.where(self._target[lo:hi] != 0, ids, IGNORE_INDEX).tolist(),
            "position_ids": None,
        }
        if self._segments is not None:
            segs = self._segments[self._seg_offsets[i] : self._seg_offsets[i + 1]]
            item["position_ids"] = positions(segs).tolist()
        return item

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def write(self, path: Path) -> None:
        """One Arrow IPC stream file (``datasets.Dataset.from_file`` opens it too), and beside it
        ``<name>.layout.json``: where each column's buffers lie in the file, so that ``open`` maps
        them with numpy alone (importing pyarrow and pandas costs a rank ~66 MiB of RSS)."""
        import pyarrow as pa

        columns = {
            "input_ids": _list_array(self._offsets, self._input_ids),
            "target": _list_array(self._offsets, self._target),
        }
        if self._segments is not None:
            columns["segments"] = _list_array(self._seg_offsets, self._segments)
        table = pa.table(columns)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=max(1, len(self)))
        _layout_path(path).write_text(json.dumps(_layout(path)))

    @classmethod
    def open(cls, path: Path) -> TokenDataset:
        """Memory-map a file written by ``write``: no copy, no pyarrow; pages load as rows are read."""
        import mmap

        path = Path(path)
        layout = json.loads(_layout_path(path).read_text())
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != layout["bytes"]:
                raise UserError(
                    Problem(
                        str(path),
                        f"is {size} bytes, but its layout says {layout['bytes']}: the cache entry was changed",
                        f"Delete the entry {path.parent} so that it is built again.",
                    )
                )
            view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

        def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
            col = layout["columns"].get(name)
            if col is None:  # no record batch: an empty dataset
                return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32)
            (o_at, o_n), (v_at, v_n, v_type) = col["offsets"], col["values"]
            offsets = np.frombuffer(view, dtype=np.int64, count=o_n, offset=o_at)
            values = np.frombuffer(view, dtype=np.dtype(v_type), count=v_n, offset=v_at)
            assert offsets[0] == 0 and offsets[-1] == v_n, f"{path}: {name} offsets do not match its values"
            return offsets, values

        offsets, ids = flat("input_ids")
        _, target = flat("target")
        segs = flat("segments") if layout["segments"] else (None, None)
        self = cls.from_arrays(ids, target, offsets, segs[1], segs[0])
        self.path = path
        return self

    def __reduce__(self):
        # Spawned DataLoader workers re-open the memory map instead of receiving a copy of the tokens.
        if self.path is not None:
            return (TokenDataset.open, (self.path,))
        return (
            TokenDataset.from_arrays,
            (self._input_ids, self._target, self._offsets, self._segments, self._seg_offsets),
        )


def _segments_of(pos: list[int]) -> list[int]:
    starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def _layout_path(path: Path) -> Path:
    return Path(path).with_suffix(".layout.json")


def _layout(path: Path) -> dict[str, Any]:
    """Byte offset and length of each column's offsets and values in the Arrow file at ``path``."""
    import pyarrow as pa

    source = pa.memory_map(str(path), "r")
    base = source.read_buffer(1).address if source.size() else 0
    source.seek(0)
    table = pa.ipc.open_stream(source).read_all()
    columns: dict[str, Any] = {}
    for name in table.column_names:
        column = table.column(name)
        if column.num_chunks == 0:
            continue
        assert column.num_chunks == 1, f"{path}: {column.num_chunks} chunks"
        arr = column.chunk(0)
        assert arr.offset == 0 and arr.values.offset == 0 and arr.null_count == 0, f"{path}: {name} is sliced"
        _, offsets, _, values = arr.buffers()
        columns[name] = {
            "offsets": [offsets.address - base, len(arr) + 1],
            "values": [values.address - base, len(arr.values), arr.type.value_type.to_pandas_dtype().__name__],
        }
    return {"bytes": source.size(), "columns": columns, "segments": "segments" in table.column_names}


def _list_array(offsets: np.ndarray, values: np.ndarray):
    import pyarrow as pa

    return pa.LargeListArray.from_arrays(pa.array(np.asarray(offsets, dtype=np.int64)), pa.array(values))


class MixedDataset:
    """Sources mixed by weight: one epoch holds ``round(weight * len(source))`` rows of each source.

    Weight 2 lists every row of the source twice, 0.5 a seeded half (a fixed
    subset for the run), 1 every row once. Indices run source after source;
    ``GlobalOrder`` shuffles them like any dataset, so the sample order stays
    a pure function of (seed, position) and resumes, also elastic ones, are exact.
    """

    def __init__(self, parts: list[TokenDataset], weights: list[float], seed: int, keys: list[str]) -> None:
        import torch

        self.parts = parts
        self._full, self._subset, bases = [], [], [0]
        for k, (part, weight) in enumerate(zip(parts, weights, strict=True)):
            n = len(part)
            total = round(weight * n)
            if total == 0:
                raise UserError(Problem(f"{keys[k]}.weight", f"{weight} of {n} rows selects none", "Raise the weight."))
            full, extra = divmod(total, n)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
            self._full.append(full)
            self._subset.append(np.sort(torch.randperm(n, generator=gen)[:extra].numpy()))
            bases.append(bases[-1] + total)
        self._bases = bases
        self.packed = all(p.packed for p in parts)

    def __len__(self) -> int:
        return self._bases[-1]

    def source_of(self, i: int) -> tuple[int, int]:
        """(source index, row in that source) of mixture index ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = bisect_right(self._bases, i) - 1
        r = i - self._bases[k]
        n = len(self.parts[k])
        return k, (r % n if r < self._full[k] * n else int(self._subset[k][r - self._full[k] * n]))

    def __getitem__(self, i: int) -> dict[str, Any]:
        k, row = self.source_of(i)
        return self.parts[k][row]


class ConcatDataset(MixedDataset):
    """Eval sources one after the other."""

    def __init__(self, parts: list[TokenDataset]) -> None:
        super().__init__(parts, [1.0] * len(parts), 0, [""] * len(parts))


@dataclass
class DataBundle:
    """The data of a run, and the one place that knows how its order and position work.

    Cached data is indexed by ``GlobalOrder`` and its position is the sample count alone; streamed
    data (``stream.StreamDataset``) orders itself and also keeps a cursor in the checkpoint
    (``TrainerState.data``) so that a resume does not re-read the stream before it.
    """

    train: TokenDataset | MixedDataset | StreamDataset | MixedStream
    eval: TokenDataset | MixedDataset | None
    eval_prompts: list[tuple[list[int], str]]  # (prompt ids incl. chat template, reference completion)
    stats: dict = field(default_factory=dict)  # train counts at the top level, eval counts under "eval"
    entries: list[dict] = field(default_factory=list)  # one per source: cache entry, built or reused, stats
    streaming: bool = False
    probabilities: list[float] | None = None  # data.mixture=probability: the sources' shares of ``train``

    @property
    def num_rows(self) -> int | None:
        """Training rows per epoch; None for a stream (its length is unknown until it is read)."""
        return None if self.streaming else len(self.train)

    def order(self, seed: int, shuffle: bool):
        """Position -> index into ``train``."""
        if self.streaming:
            return StreamOrder()
        if self.probabilities is not None:
            return ProbabilityOrder([len(p) for p in self.train.parts], self.probabilities, seed, shuffle)
        return GlobalOrder(len(self.train), seed, shuffle)

    def epoch(self, samples: int) -> float:
        return self.train.epoch(samples) if self.streaming else samples / len(self.train)

    def state_at(self, samples: int) -> dict[str, Any]:
        """What a checkpoint at ``samples`` consumed samples keeps besides the count (``TrainerState.data``)."""
        return {"stream": self.train.cursor_at(samples)} if self.streaming else {}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``state_at``; a stream without a cursor re-reads from its start."""
        cursor = state.get("stream")
        if not self.streaming or cursor is None:
            return
        sources = len(self.train.streams) if isinstance(self.train, MixedStream) else 1
        saved = len(cursor) if isinstance(cursor, list) else 1
        if saved != sources:
            raise UserError(
                Problem(
                    "data.train",
                    f"streams {sources} source(s), but the checkpoint's stream cursor is for {saved}",
                    "Resume with the data.train the checkpoint was trained on, or set checkpoint.resume=never.",
                )
            )
        self.train.restore(cursor)


@dataclass
class _SourceData:
    rows: TokenDataset
    held: TokenDataset | None
    prompts: list[tuple[list[int], str]]
    meta: dict


def build_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, env: DistEnv | None = None) -> DataBundle:
    """Train (and eval) datasets as the training loop consumes them; ``data.eval`` or a seeded holdout.

    Every rank may call this at once: the first to need a cache entry builds it, the others wait for
    it (``cache.get_or_build``) and memory-map it. ``env`` only quiets the logs of ranks other than 0.
    ``data.chat_template`` is applied to ``tokenizer`` itself, so checkpoints and exports carry it.
    """
    from llmft.tokenizer import use_chat_template

    cfg = recipe.data
    use_chat_template(tokenizer, cfg.chat_template)
    quiet = env is not None and not env.is_main
    common = _common_parts(cfg, tokenizer)
    holdout = cfg.eval_fraction if cfg.eval is None else 0.0
    train_sources = parse_sources(cfg.train, "data.train", weights=True)
    if cfg.streaming:
        return _build_stream(recipe, tokenizer, train_sources, common, quiet)
    train = [_source(s, cfg, tokenizer, common, holdout, recipe.run.seed, quiet) for s in train_sources]
    evals = []
    if cfg.eval is not None:
        evals = [_source(s, cfg, tokenizer, common, 0.0, recipe.run.seed, quiet, eval_role=True)
                 for s in parse_sources(cfg.eval, "data.eval", weights=False)]  # fmt: skip

    parts = [t.rows for t in train]
    probabilities = None
    if cfg.mixture == "probability" and len(parts) > 1:
        train_ds: TokenDataset | MixedDataset = ConcatDataset(parts)
        probabilities = _probabilities(train_sources)
    elif len(parts) == 1 and (train_sources[0].weight == 1.0 or cfg.mixture == "probability"):
        train_ds = parts[0]
    else:
        weights = [s.weight for s in train_sources]
        train_ds = MixedDataset(parts, weights, recipe.run.seed, [s.key for s in train_sources])
    stats = _sum_stats([t.meta["stats"] for t in train], cfg)
    if len(train) > 1:
        stats["mixture_rows"] = len(train_ds)

    eval_ds, prompts, eval_stats = None, [], None
    if evals:
        eval_parts, prompts = [e.rows for e in evals], [p for e in evals for p in e.prompts]
        eval_stats = _sum_stats([e.meta["stats"] for e in evals], cfg)
    elif holdout > 0:
        eval_parts, prompts = [t.held for t in train], [p for t in train for p in t.prompts]
        eval_stats = _sum_stats([t.meta["held_stats"] for t in train], cfg)
    if eval_stats is not None:
        eval_ds = eval_parts[0] if len(eval_parts) == 1 else ConcatDataset(eval_parts)
        eval_stats["prompts"] = len(prompts)
        stats["eval"] = eval_stats
    entries = [
        {"source": s.describe(), "key": s.key, **_entry_info(d)} for s, d in zip(train_sources, train, strict=True)
    ]
    if evals:
        eval_keys = parse_sources(cfg.eval, "data.eval", weights=False)
        entries += [
            {"source": s.describe(), "key": s.key, **_entry_info(d)} for s, d in zip(eval_keys, evals, strict=True)
        ]
    return DataBundle(train_ds, eval_ds, prompts, stats, entries, probabilities=probabilities)


def _probabilities(sources: list[Source]) -> list[float]:
    """``data.mixture: probability``: each weight over their sum; every source must get a slot per window."""
    total = sum(s.weight for s in sources)
    counts = largest_remainder([s.weight for s in sources], ProbabilityOrder.WINDOW)
    for s, c in zip(sources, counts, strict=True):
        if c == 0:
            raise UserError(
                Problem(
                    f"{s.key}.weight",
                    f"{s.weight} of {total} is less than one sample in {ProbabilityOrder.WINDOW:,}",
                    "Raise the weight, or drop the source.",
                )
            )
    return [s.weight / total for s in sources]


def _build_stream(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase, sources: list[Source], common: dict, quiet: bool
) -> DataBundle:
    """``data.streaming``: the train source as a ``StreamDataset`` (several: a ``MixedStream``); eval data is cached."""
    cfg = recipe.data
    problems = []
    if cfg.mixture == "repeat" and (len(sources) > 1 or sources[0].weight != 1.0):
        problems.append(
            Problem(
                "data.mixture",
                "is 'repeat' (weights as times per epoch), which needs each source's length: a stream's is unknown",
                "Set data.mixture=probability (each weight a share of the samples), or data.streaming=false.",
            )
        )
    if recipe.train.max_steps is None:
        problems.append(
            Problem(
                "train.max_steps",
                "is not set, and train.epochs cannot be turned into steps for a stream of unknown length",
                "Set train.max_steps with data.streaming=true.",
            )
        )
    if cfg.eval is None and cfg.eval_fraction > 0:
        problems.append(
            Problem(
                "data.eval_fraction",
                f"is {cfg.eval_fraction}, but a stream cannot hold out a fraction of records it has not read",
                "Set data.eval to separate eval data, or data.eval_fraction=0.",
            )
        )
    if problems:
        raise UserError(*problems)
    seed = recipe.run.seed
    if len(sources) == 1:
        train: StreamDataset | MixedStream = open_stream(sources[0], cfg, tokenizer, seed)
    else:  # each source with its own seed, as ProbabilityOrder seeds the sources of a cached mixture
        streams = [open_stream(s, cfg, tokenizer, source_seed(seed, k)) for k, s in enumerate(sources)]
        train = MixedStream(streams, _probabilities(sources), seed)
    eval_ds, prompts, stats, entries = None, [], {"streaming": True}, []
    if cfg.eval is not None:
        eval_sources = parse_sources(cfg.eval, "data.eval", weights=False)
        evals = [_source(s, cfg, tokenizer, common, 0.0, recipe.run.seed, quiet, eval_role=True) for s in eval_sources]
        parts, prompts = [e.rows for e in evals], [p for e in evals for p in e.prompts]
        eval_ds = parts[0] if len(parts) == 1 else ConcatDataset(parts)
        stats["eval"] = {**_sum_stats([e.meta["stats"] for e in evals], cfg), "prompts": len(prompts)}
        entries = [
            {"source": s.describe(), "key": s.key, **_entry_info(d)} for s, d in zip(eval_sources, evals, strict=True)
        ]
    if not quiet:
        for s in sources:
            log.info(
                "%s: streamed (%s), blocks of %d records tokenized as training reaches them",
                s.key, s.describe(), cfg.stream_block,
            )  # fmt: skip
    return DataBundle(train, eval_ds, prompts, stats, entries, streaming=True)


def _entry_info(d: _SourceData) -> dict:
    return {"entry": d.meta["entry"], "built": d.meta["built"], "bytes": d.meta["bytes"], "stats": d.meta["stats"]}


def _common_parts(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    from llmft import __version__

    return {
        "llmft": __version__,
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": tokenizer.chat_template,
        "max_seq_len": cfg.max_seq_len,
        "packing": cfg.packing,
        "on_bad_record": cfg.on_bad_record,
    }


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def _source(
    src: Source,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    common: dict[str, Any],
    holdout: float,
    seed: int,
    quiet: bool,
    eval_role: bool = False,
) -> _SourceData:
    resolved = resolve(src)
    work = Path(tempfile.mkdtemp(prefix="llmft-read-"))
    try:
        chunks: list[Chunk] | None = None
        identity = resolved.identity()
        if resolved.kind == "hub":  # the fingerprint of the hub data is known only once it is loaded
            chunks, identity["fingerprint"] = read(resolved, work)
        parts = {
            **common,
            "source": identity,
            "train_on": src.train_on or cfg.train_on,
            "role": "eval" if eval_role else "train",
            "holdout": [holdout, seed] if holdout > 0 else None,
        }

        def build(tmp: Path) -> dict[str, Any]:
            nonlocal chunks
            # Local files are read into the entry's own build dir (on the cache's disk, not /tmp):
            # the lines of a JSONL file as an Arrow file the tokenizing workers map.
            scratch = tmp / "read"
            try:
                if chunks is None:
                    chunks, _ = read(resolved, scratch)
                return _build_entry(src, chunks, cfg, tokenizer, parts["train_on"], holdout, seed, eval_role, tmp)
            finally:
                chunks = None  # its datasets map files in scratch
                shutil.rmtree(scratch, ignore_errors=True)

        entry, built = get_or_build(cache_root(cfg), parts, build)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = read_meta(entry)
    meta.update(entry=str(entry), built=built, bytes=size_of(entry))
    if not quiet:
        _log_source(src.key, meta, built)
    held = TokenDataset.open(entry / "held.arrow") if (entry / "held.arrow").exists() else None
    prompts = [(p, ref) for p, ref in json.loads((entry / "prompts.json").read_text())]
    return _SourceData(TokenDataset.open(entry / "rows.arrow"), held, prompts, meta)


def _log_source(key: str, meta: dict, built: bool) -> None:
    stats, how = meta["stats"], ("built" if built else "reused")
    if meta.get("skipped"):
        log.warning(
            "%s: skipped %d malformed record(s) (data.on_bad_record=skip); the first: %s",
            key,
            stats["skipped"],
            meta["skipped"],
        )
    for s, k in ((stats, key), (meta.get("held_stats"), f"{key} (eval holdout)")):
        if s:
            _warn_shortened(k, s["records"], s["truncated"], s["dropped_no_targets"], meta["parts"]["max_seq_len"])
    log.info(
        "%s: %s; cache %s %s",
        key,
        ", ".join(
            f"{k} {stats[k]:,}" if isinstance(stats[k], int) else f"{k} {stats[k]:.1%}"
            for k in _STAT_ORDER
            if k in stats
        ),
        how,
        meta["entry"],
    )


_STAT_ORDER = (
    "records", "skipped", "truncated", "dropped_no_targets", "examples", "tokens", "target_tokens", "rows",
    "packing_efficiency",
)  # fmt: skip


def _warn_shortened(key: str, total: int, truncated: int, dropped: int, max_seq_len: int) -> None:
    if truncated:
        log.warning("%s: truncated %d of %d records to data.max_seq_len=%d tokens", key, truncated, total, max_seq_len)
    if dropped:
        log.warning("%s: dropped %d of %d records with no target token left after truncation", key, dropped, total)


def _sum_stats(all_stats: list[dict], cfg: DataConfig) -> dict:
    keys = ("records", "truncated", "dropped_no_targets", "examples", "tokens", "target_tokens", "rows")
    out = {k: sum(s[k] for s in all_stats) for k in keys}
    if cfg.packing:
        out["packed_rows"] = out["rows"]
        out["packing_efficiency"] = out["tokens"] / max(1, out["rows"] * cfg.max_seq_len)
    out["skipped"] = sum(s.get("skipped", 0) for s in all_stats)
    return out


# --- building one entry --------------------------------------------------------------


class _Tokenize:
    """The ``Dataset.map`` function: raw records -> input_ids, target mask, error (picklable for workers)."""

    def __init__(self, encoder: Encoder, lines: bool, fields: dict[str, str]) -> None:
        self.encoder, self.lines, self.fields = encoder, lines, fields

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        n = len(next(iter(batch.values())))
        errors: list[str | None] = [None] * n
        records, at = [], []
        for k in range(n):
            try:
                if self.lines:
                    value = parse_line(batch["json"][k], batch["error"][k])
                else:
                    value = {c: batch[c][k] for c in batch}
                records.append(parse_record(value, self.fields))
                at.append(k)
            except ValueError as e:  # BadRecord, or a line that is not JSON
                errors[k] = str(e)
        empty_ids, empty_target = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        ids: list[np.ndarray] = [empty_ids] * n
        target: list[np.ndarray] = [empty_target] * n
        try:
            encoded = self.encoder.encode_batch(records)
        except UserError as e:  # e.g. no chat template: stops the build, whatever data.on_bad_record says
            p = e.problems[0]
            return {"input_ids": ids, "target": target, "error": [_FATAL + json.dumps([p.where, p.what, p.fix])] * n}
        for k, ex in zip(at, encoded, strict=True):
            if isinstance(ex, BadRecord):
                errors[k] = str(ex)
            else:
                ids[k] = np.asarray(ex.input_ids, dtype=np.int32)
                if ex.labels is ex.input_ids:  # every token a target
                    target[k] = np.ones(len(ids[k]), dtype=np.uint8)
                else:
                    target[k] = (np.asarray(ex.labels) != IGNORE_INDEX).astype(np.uint8)
        return {"input_ids": ids, "target": target, "error": errors}


def _num_proc(cfg: DataConfig, records: int) -> int:
    wanted = cfg.num_proc or len(os.sched_getaffinity(0))
    return max(1, min(wanted, records // _RECORDS_PER_PROC))


def _tokenize_chunk(chunk: Chunk, encoder: Encoder, src: Source, cfg: DataConfig, tmp: Path, i: int):
    import datasets

    features = datasets.Features(
        input_ids=datasets.List(datasets.Value("int32")),
        target=datasets.List(datasets.Value("uint8")),
        error=datasets.Value("string"),
    )
    ds = chunk.dataset
    procs = _num_proc(cfg, len(ds))
    quiet = len(ds) < 10 * _RECORDS_PER_PROC  # a progress bar only where tokenizing takes a while
    was = datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        return ds.map(
            _Tokenize(encoder, chunk.lines, src.fields),
            batched=True,
            batch_size=256,
            num_proc=procs if procs > 1 else None,
            remove_columns=ds.column_names,
            features=features,
            new_fingerprint=f"llmft-{tmp.name}-{i}"[-64:],
            cache_file_name=str(tmp / "map" / f"chunk{i}.arrow") if procs > 1 else None,
            keep_in_memory=procs == 1,
            load_from_cache_file=False,
            desc=f"tokenizing {src.key} ({procs} process{'es' if procs > 1 else ''})",
        )
    finally:
        if quiet and was:
            datasets.enable_progress_bars()


def _build_entry(
    src: Source,
    chunks: list[Chunk],
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_on: str,
    holdout: float,
    seed: int,
    eval_role: bool,
    tmp: Path,
) -> dict[str, Any]:
    encoder = Encoder(tokenizer, train_on)
    (tmp / "map").mkdir()
    chunks = [c for c in chunks if len(c.dataset)]
    tokenized = [_tokenize_chunk(c, encoder, src, cfg, tmp, i) for i, c in enumerate(chunks)]
    bad, errors = _errors(tokenized)
    ids, target, offsets = _flat(tokenized)
    for e in errors:
        if e.startswith(_FATAL):
            raise UserError(Problem(*json.loads(e[len(_FATAL) :])))
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
    rows, meta["stats"] = _rows(ids, target, offsets, items, cfg, tokenizer.pad_token_id, src.key)
    meta["stats"]["skipped"] = len(bad)
    rows.write(tmp / "rows.arrow")
    prompt_items = items if eval_role else held_items
    if held_items is not None:
        held, meta["held_stats"] = _rows(ids, target, offsets, held_items, cfg, tokenizer.pad_token_id, src.key)
        meta["held_stats"]["skipped"] = 0
        held.write(tmp / "held.arrow")
    prompts = _eval_prompts(chunks, prompt_items, encoder, src, cfg) if prompt_items is not None else []
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    shutil.rmtree(tmp / "map", ignore_errors=True)
    return meta


def _errors(tokenized: list) -> tuple[np.ndarray, list[str]]:
    """The indices of the records that have an error, and those errors (no per-record Python list)."""
    import pyarrow as pa

    column = pa.chunked_array([c for t in tokenized for c in t.data.column("error").chunks], type=pa.string())
    bad = np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False)).astype(np.int64)
    return bad, column.take(pa.array(bad)).to_pylist()


def _flat(tokenized: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All chunks' input_ids and target masks as flat arrays with record offsets."""
    import pyarrow as pa

    def column(name: str) -> tuple[np.ndarray, np.ndarray]:
        pieces = [chunk for t in tokenized for chunk in t.data.column(name).chunks]
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
    import torch

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


def _kept_tokens(
    ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, starts: np.ndarray, kept_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of the kept records (``kept_len`` tokens from each of ``starts``), in that order:
    ``ids[ranges(starts, kept_len)]``, gathered a block at a time (``take_ranges``), or the arrays
    themselves when every token of every record is kept in file order."""
    if len(starts) == len(offsets) - 1 and np.array_equal(kept_len, np.diff(offsets)):
        return ids, target  # every token of every record, in file order: nothing to copy
    return take_ranges((ids, target), starts, kept_len)


def _prefix_counts(mask: np.ndarray, at: np.ndarray, block: int = 1 << 20) -> np.ndarray:
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


def _rows(
    ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, items: np.ndarray, cfg: DataConfig, pad_id: int, key: str
) -> tuple[TokenDataset, dict]:
    """Truncate ``items`` to max_seq_len, drop those without a target, then pack (or not)."""
    starts, lengths = offsets[items], offsets[items + 1] - offsets[items]
    kept_len = np.minimum(lengths, cfg.max_seq_len)
    truncated = int((lengths > cfg.max_seq_len).sum())
    # Targets at positions 1 .. kept_len-1 (labels[0] is never predicted), from a running count.
    first, end = np.minimum(starts + 1, starts + kept_len), starts + kept_len
    counts = _prefix_counts(target, np.concatenate([first, end]))
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
    if cfg.packing:
        packed = pack_arrays(ids, target, starts, kept_len, cfg.max_seq_len, pad_id)
        num_rows = len(packed.segment_offsets) - 1
        row_offsets = np.arange(num_rows + 1, dtype=np.int64) * cfg.max_seq_len
        rows = TokenDataset.from_arrays(
            packed.input_ids, packed.target, row_offsets, packed.segments, packed.segment_offsets
        )
    else:
        row_offsets = np.concatenate([[0], np.cumsum(kept_len)]).astype(np.int64)
        rows = TokenDataset.from_arrays(*_kept_tokens(ids, target, offsets, starts, kept_len), row_offsets)
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


def _eval_prompts(chunks: list[Chunk], items: np.ndarray, encoder: Encoder, src: Source, cfg: DataConfig) -> list:
    """(prompt ids, reference) of the eval records that have a prompt shorter than max_seq_len."""
    locate, out = _Locate(chunks), []
    for i in items.tolist():
        chunk, row = locate.record(i)
        raw = chunk.dataset[row]
        value = parse_line(raw["json"], raw["error"]) if chunk.lines else raw
        prompt = encoder.eval_prompt(parse_record(value, src.fields))
        # A prompt must leave room to generate at least one token within the context.
        if prompt is not None and len(prompt[0]) < cfg.max_seq_len:
            out.append(prompt)
    return out


def resolve_sources(value: Any, key: str) -> list[Resolved]:
    """The resolved sources of a data key (for ``llmft prepare`` messages)."""
    return [resolve(s) for s in parse_sources(value, key, weights=key == "data.train")]
