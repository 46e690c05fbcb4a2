"""``build_data``: from ``data.*`` keys to the run's datasets (a ``DataBundle``), through the cache.

Each source of ``data.train`` / ``data.eval`` becomes one cache entry (``cache.py``): the first
process that needs it reads the records (``read``) and builds the entry (``entry.build_entry``:
tokenize in worker processes, hold out ``data.eval_fraction``, truncate, pack, write the rows
as an Arrow file); every process then memory-maps that file (``tokens.TokenDataset.open``), so N
ranks share one copy of the tokens in the page cache and a resume, requeue or second run starts
without tokenizing. With ``data.streaming`` the train sources become streams (``stream``) instead.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llmft
from llmft import stop
from llmft.data.bundle import DataBundle
from llmft.data.cache import CACHE_FORMAT, default_cache_dir, get_or_build, read_meta, size_of, tokenizer_fingerprint
from llmft.data.entry import build_entry, read_prompts
from llmft.data.kinds import KindCode, kind_code
from llmft.data.mixture import ConcatDataset, MixedDataset, probabilities
from llmft.data.read import Chunk, read, resolve
from llmft.data.sampler import source_seed
from llmft.data.sources import Source, parse_sources
from llmft.data.stream import MixedStream, StreamDataset, open_stream
from llmft.data.tokenizer import use_chat_template
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError
from llmft.plan.kinds import RecordKind, kind_spec
from llmft.plan.objectives import DEFAULT_OBJECTIVE, ObjectiveSpec, objective_spec

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedTokenizerBase

    from llmft.job.dist import DistEnv
    from llmft.recipe.schema import DataConfig, Recipe

log = logging.getLogger("llmft.data")


@dataclass
class _SourceData:
    """One source's cache entry, opened: its rows, the held-out rows, eval prompts and the entry's meta."""

    rows: TokenDataset
    held: TokenDataset | None
    prompts: list[tuple[np.ndarray, str]]
    meta: dict


def build_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, env: DistEnv | None = None) -> DataBundle:
    """Train (and eval) datasets as the training loop consumes them; ``data.eval`` or a seeded holdout.

    Every rank may call this at once: the first to need a cache entry builds it, the others wait for
    it (``cache.get_or_build``) and memory-map it. ``env`` only quiets the logs of ranks other than 0.
    ``data.chat_template`` is applied to ``tokenizer`` itself, so checkpoints and exports carry it.
    """
    cfg = recipe.data
    use_chat_template(tokenizer, cfg.chat_template)
    quiet = env is not None and not env.is_main
    spec = objective_spec(recipe.train.objective)
    kind = kind_spec(spec.record)
    common = _common_parts(cfg, tokenizer, spec, kind_code(kind).room(recipe))
    holdout = cfg.eval_fraction if cfg.eval is None else 0.0
    train_sources = parse_sources(cfg.train, "data.train", weights=True, open_fields=kind.open_fields)
    if cfg.streaming:
        return _grouped(_build_stream(recipe, spec, tokenizer, train_sources, common, quiet), recipe, spec)
    train = [_source(s, cfg, tokenizer, spec, common, holdout, recipe.run.seed, quiet) for s in train_sources]
    evals = []
    if cfg.eval is not None:
        evals = [_source(s, cfg, tokenizer, spec, common, 0.0, recipe.run.seed, quiet, eval_role=True)
                 for s in parse_sources(cfg.eval, "data.eval", weights=False, open_fields=kind.open_fields)]  # fmt: skip

    parts = [t.rows for t in train]
    shares = None
    if cfg.mixture == "probability" and len(parts) > 1:
        train_ds: TokenDataset | MixedDataset = ConcatDataset(parts)
        shares = probabilities(train_sources)
    elif len(parts) == 1 and (train_sources[0].weight == 1.0 or cfg.mixture == "probability"):
        train_ds = parts[0]
    else:
        weights = [s.weight for s in train_sources]
        train_ds = MixedDataset(parts, weights, recipe.run.seed, [s.key for s in train_sources])
    stats = _sum_stats([t.meta["stats"] for t in train], cfg, kind)
    if len(train) > 1:
        stats["mixture_rows"] = len(train_ds)

    eval_ds, prompts, eval_stats = None, [], None
    if evals:
        eval_parts, prompts = [e.rows for e in evals], [p for e in evals for p in e.prompts]
        eval_stats = _sum_stats([e.meta["stats"] for e in evals], cfg, kind)
    elif holdout > 0:
        eval_parts, prompts = [t.held for t in train], [p for t in train for p in t.prompts]
        eval_stats = _sum_stats([t.meta["held_stats"] for t in train], cfg, kind)
    if eval_stats is not None:
        eval_ds = eval_parts[0] if len(eval_parts) == 1 else ConcatDataset(eval_parts)
        eval_stats["prompts"] = len(prompts)
        stats["eval"] = eval_stats
    entries = [
        {"source": s.describe(), "key": s.key, **_entry_info(d)} for s, d in zip(train_sources, train, strict=True)
    ]
    if evals:
        eval_keys = parse_sources(cfg.eval, "data.eval", weights=False, open_fields=kind.open_fields)
        entries += [
            {"source": s.describe(), "key": s.key, **_entry_info(d)} for s, d in zip(eval_keys, evals, strict=True)
        ]
    bundle = DataBundle(train_ds, eval_ds, prompts, stats, entries, probabilities=shares)
    return _grouped(bundle, recipe, spec)


def _grouped(bundle: DataBundle, recipe: Recipe, spec: ObjectiveSpec) -> DataBundle:
    """The bundle of ``spec``'s record kind; an objective with G items per record (``ObjectiveSpec.group``:
    GRPO's G completions per prompt) takes each record G times in a row (``DataBundle.group_by``, the
    kind's ``grouped`` wrapping)."""
    bundle.kind = spec.record
    if spec.group is not None:
        wrap = kind_code(spec.record).grouped  # type: ignore[attr-defined]
        bundle.group_by(spec.group_size(recipe), recipe.run.seed, recipe.data.shuffle, wrap)
    return bundle


def _build_stream(
    recipe: Recipe,
    spec: ObjectiveSpec,
    tokenizer: PreTrainedTokenizerBase,
    sources: list[Source],
    common: dict,
    quiet: bool,
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
        train: StreamDataset | MixedStream = open_stream(
            sources[0], cfg, tokenizer, seed, spec, common.get("max_prompt_len")
        )
    else:  # each source with its own seed, as ProbabilityOrder seeds the sources of a cached mixture
        streams = [
            open_stream(s, cfg, tokenizer, source_seed(seed, k), spec, common.get("max_prompt_len"))
            for k, s in enumerate(sources)
        ]
        train = MixedStream(streams, probabilities(sources), seed)
    eval_ds, prompts, stats, entries = None, [], {"streaming": True}, []
    if cfg.eval is not None:
        kind = kind_spec(spec.record)
        eval_sources = parse_sources(cfg.eval, "data.eval", weights=False, open_fields=kind.open_fields)
        evals = [
            _source(s, cfg, tokenizer, spec, common, 0.0, recipe.run.seed, quiet, eval_role=True) for s in eval_sources
        ]
        parts, prompts = [e.rows for e in evals], [p for e in evals for p in e.prompts]
        eval_ds = parts[0] if len(parts) == 1 else ConcatDataset(parts)
        stats["eval"] = {**_sum_stats([e.meta["stats"] for e in evals], cfg, kind), "prompts": len(prompts)}
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


def _common_parts(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, objective: ObjectiveSpec | None = None, room: int | None = None
) -> dict[str, Any]:
    """What every cache key of this run's data holds; ``objective``'s record kind (default: SFT's)
    names its own format, and ``room`` (``KindCode.room``) the most tokens a record may have."""
    objective = objective or objective_spec(DEFAULT_OBJECTIVE)
    kind = kind_spec(objective.record)
    parts = {
        "llmft": llmft.__version__,
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": tokenizer.chat_template,
        "max_seq_len": cfg.max_seq_len,
        "packing": cfg.packing,
        "on_bad_record": cfg.on_bad_record,
    }
    if kind.cache_format is not None:
        # An entry of another kind has its own format and names its objective, so it is never read as
        # SFT rows (nor an SFT entry as another kind's); SFT keys stay as they were.
        parts.update(format=kind.cache_format, objective=objective.name)
    if not kind.packs:  # its rows do not depend on data.packing (pairs: padding-free is a collation)
        parts["packing"] = None
    if room is not None:  # prompts: the ones that fit the room generation leaves, one per row
        parts["max_prompt_len"] = room
    fields = objective.fields
    if fields:  # an entry holds the record fields it was built with (keys without fields stay as they were)
        parts["fields"] = list(fields)
    return parts


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def _source(
    src: Source,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    objective: ObjectiveSpec,
    common: dict[str, Any],
    holdout: float,
    seed: int,
    quiet: bool,
    eval_role: bool = False,
) -> _SourceData:
    resolved = resolve(src)
    code = kind_code(objective.record)
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

        def build(tmp: Path, shards: Path) -> dict[str, Any]:
            nonlocal chunks
            # Local files are read into the entry's own build dir (on the cache's disk, not /tmp):
            # the lines of a JSONL file as an Arrow file the tokenizing workers map.
            scratch = tmp / "read"
            try:
                if chunks is None:
                    chunks, _ = read(resolved, scratch)
                fields = tuple(parts.get("fields", ()))  # the record fields its key names
                args = (src, chunks, cfg, tokenizer, parts["train_on"], holdout, seed, eval_role, tmp, shards)
                return build_entry(*args, objective, fields, parts.get("max_prompt_len"))
            finally:
                chunks = None  # its datasets map files in scratch
                shutil.rmtree(scratch, ignore_errors=True)

        # A stop while this process builds the entry, or waits for another to build it, ends the build.
        with stop.during(stop.BUILDING):
            entry, built = get_or_build(cache_root(cfg), parts, build)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = read_meta(entry)
    meta.update(entry=str(entry), built=built, bytes=size_of(entry))
    if not quiet:
        _log_source(src.key, meta, built)
    held = _open_rows(entry / "held.arrow", code, cfg) if (entry / "held.arrow").exists() else None
    return _SourceData(_open_rows(entry / "rows.arrow", code, cfg), held, read_prompts(entry), meta)


def _open_rows(path: Path, code: KindCode, cfg: DataConfig) -> Any:
    """A mapped entry's rows as the items of its kind (``KindCode.open``: pairs as a ``PairDataset``)."""
    return code.open(TokenDataset.open(path), cfg, path)


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


def _sum_stats(all_stats: list[dict], cfg: DataConfig, kind: RecordKind) -> dict:
    keys = ("records", "truncated", "dropped_no_targets", "examples", "tokens", "target_tokens", "rows")
    out = {k: sum(s[k] for s in all_stats) for k in keys}
    kind_code(kind).totals(out, cfg)
    out["skipped"] = sum(s.get("skipped", 0) for s in all_stats)
    return out
