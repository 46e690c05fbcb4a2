"""Precomputed reference log-probs (``preference.precompute_reference: true``).

A DPO-family loss reads, per pair, the reference model's log-probs of chosen and rejected. They
depend only on the reference weights and the pair's tokens, so they are computed once, in a
sharded pass, and stored with the pair's token cache entry:

    <data cache entry>/reference/<fingerprint>/<rows|held>.npy    float32 [pairs, 4]
    <data cache entry>/reference/<fingerprint>/<rows|held>.json   what was hashed, crc32, timing

Each ``.npy`` row is (chosen sum, rejected sum, chosen target tokens, rejected target tokens):
the SUM of the target tokens' log-probs (``sequence_logps``) and the count, so the mean-per-token
losses (``ipo``) divide by the same count the policy's side uses. The ``.json`` is written last
and names the ``.npy``'s crc32: a file without it, or not matching it, is computed again.

``fingerprint`` hashes what the reference weights are made of (docs/preference.md
"Precomputed reference"): the model's name or resolved directory and revision; for a fresh model
its ``model.config`` and ``run.seed`` (the seeded init, the same with or without adapters); the dtype,
quantization and attention kernel it runs with; and each weight file's name, size, mtime and
safetensors header (tensor names, dtypes, shapes, offsets) — for a hub snapshot the blob each
file links to, which the hub names by the file's sha256. A changed weight file changes its size,
its mtime or its blob, so the key changes; the values are not re-read (an 8B model's 16 GB
would cost every start seconds). LoRA, DoRA and QLoRA (adapters disabled) and a full fine-tune
(a frozen copy of the initial weights) of the same base share one key: their reference is the
same function of the same weights. ``preference.reference: <model>`` hashes that model.

The pass: the pairs of each dataset, in fixed batches of ``batch.micro_batch_size`` pairs (by
index, whatever the world size), are dealt round-robin to the ranks (to the sequence groups with
``distributed.sequence_parallel``, whose ranks each score a slice of the group's batch); every rank runs the same
number of forwards (a rank out of batches scores batch 0 again and drops it: under FSDP2 and
ZeRO-3 a forward is collective), and the results are gathered to every rank, so 1 and N ranks
compute the same numbers and write the same file. The reference is the one the run would use on
the fly: the policy with its adapters disabled (LoRA), the policy itself before the checkpoint is
loaded (full fine-tune: its initial weights; so no frozen copy is built), or the named model,
which is asked of the engine (``Engine.frozen_model``) for the pass and dropped after it. Training then holds no reference model
and runs no reference forward: each pair's item carries ``reference_logps`` and the collator
puts them in the micro-batch (``kinds.pairs.collate_pairs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

import llmft
from llmft.data.kinds.pairs import PairDataset, collate_pairs
from llmft.data.sequence import rank_slice
from llmft.job.dist import barrier, broadcast_object
from llmft.objectives import Models, disable_dropout
from llmft.objectives.sequences import SequenceSlices, model_sequence_logps
from llmft.plan.layout import RunPlan
from llmft.plan.objectives import ADAPTERS_DISABLED, FROZEN_COPY, NO_REFERENCE, REFERENCE_MODEL

if TYPE_CHECKING:
    from llmft.data.bundle import DataBundle
    from llmft.engines import Engine
    from llmft.job.dist import DistEnv

log = logging.getLogger("llmft")

PRECOMPUTE_FORMAT = 1  # the layout of the files and how the log-probs are computed
REFERENCE_DIR = "reference"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model")


def precomputing(plan: RunPlan) -> bool:
    """Whether this run reads its reference log-probs from the cache (resolve refuses it otherwise)."""
    return plan.recipe.preference.precompute_reference and plan.reference != NO_REFERENCE


# --- the key -------------------------------------------------------------------------------------


def fingerprint_parts(plan: RunPlan) -> dict[str, Any] | None:
    """What the reference weights are made of (module docstring); None when a hub model's files
    are not on this machine yet (the engine downloads them; the key is taken again after)."""
    r, m = plan.recipe, plan.recipe.model
    named = plan.reference == REFERENCE_MODEL
    name = r.preference.reference if named else m.name_or_path
    parts: dict[str, Any] = {
        "format": PRECOMPUTE_FORMAT,
        "dtype": m.dtype,
        "quantization": dataclasses.asdict(m.quantization) if m.quantization is not None else None,
        "attn_implementation": m.attn_implementation,
    }
    if name is None:  # a fresh model: the seeded init is its weights
        parts.update(config=m.config, seed=r.run.seed)
        return parts
    directory = _model_dir(name, None if named else m.revision)
    if directory is None:
        return None
    parts.update(model=name, revision=None if named else m.revision, files=_file_facts(directory))
    return parts


def fingerprint(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _model_dir(name: str, revision: str | None) -> Path | None:
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # not downloaded yet (or not a hub id: the engine says so)
        return None


def _file_facts(directory: Path) -> list[list[Any]]:
    facts = []
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or not path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        real = Path(os.path.realpath(path))
        st = real.stat()
        blob = real.name if real != path else None  # hub cache: blobs are named by their sha256
        header = _safetensors_header(real) if path.suffix == ".safetensors" else None
        facts.append([str(path.relative_to(directory)), st.st_size, blob or st.st_mtime_ns, header])
    return facts


def _safetensors_header(path: Path) -> str | None:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return None
        (n,) = struct.unpack("<Q", raw)
        return hashlib.sha256(f.read(min(n, 1 << 28))).hexdigest()[:16]


# --- the engine's plan ---------------------------------------------------------------------------


def frozen_reference(plan: RunPlan, models: Models) -> torch.nn.Module | None:
    """The separate reference model a preference run's plan needs, asked of the engine (built and
    sharded like the policy): a frozen copy of the initial weights (``FROZEN_COPY``) or the model
    ``preference.reference`` names (``REFERENCE_MODEL``); None when the reference is the policy with
    its adapters off (``ADAPTERS_DISABLED``: no model) or there is none."""
    if plan.reference == FROZEN_COPY:
        return models.frozen_model()
    if plan.reference == REFERENCE_MODEL:
        return models.frozen_model(plan.frozen_model_plan(plan.recipe.preference.reference))
    return None


def pair_datasets(data: DataBundle) -> list[PairDataset]:
    """Every cached pair dataset of the run (train sources, held-out and eval sources), once each."""
    out: list[PairDataset] = []
    for ds in (data.train, data.eval):
        for part in getattr(ds, "parts", [ds]):
            if isinstance(part, PairDataset) and all(part is not o for o in out):
                out.append(part)
    return out


# --- the pass ------------------------------------------------------------------------------------


def precompute_references(plan: RunPlan, engine: Engine, data: DataBundle, env: DistEnv, pad_id: int) -> None:
    """Attach the reference log-probs to every pair dataset of ``data``: read from the cache, or
    computed by the sharded pass (every rank takes part) and stored there. A named reference model
    is asked of the engine only when some are not stored, and dropped after the pass. Called after
    the engine is built, before a checkpoint is loaded."""
    parts = fingerprint_parts(plan)
    assert parts is not None, "the engine has the model's files now"
    key = fingerprint(parts)
    datasets = pair_datasets(data)
    assert all(ds.path is not None for ds in datasets), "pair datasets of a run come from the cache"
    stored = broadcast_object([_load(ds, key) is not None for ds in datasets] if env.is_main else None)
    named = frozen_reference(plan, engine) if plan.reference == REFERENCE_MODEL and not all(stored) else None
    for ds, hit in zip(datasets, stored, strict=True):
        values = _load(ds, key) if hit else None
        if values is None:
            started = time.time()
            values = _score(plan, engine, named, ds, env, pad_id)
            if env.is_main:
                _store(ds, key, parts, values, time.time() - started, env.world_size)
            barrier()
            if env.is_main:
                log.info(
                    "reference log-probs: computed %d pairs on %d rank(s) in %.1f s; stored in %s",
                    len(ds), env.world_size, time.time() - started, _files(ds, key)[0],
                )  # fmt: skip
        elif env.is_main:
            log.info("reference log-probs: reused %s (%d pairs)", _files(ds, key)[0], len(ds))
        ds.reference = values


def _reference_forward(
    plan: RunPlan, engine: Engine, named: torch.nn.Module | None
) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
    if plan.reference == ADAPTERS_DISABLED:
        policy = engine.unwrap()
        return policy, policy.disable_adapter()
    if plan.reference == FROZEN_COPY:  # before restore(): the policy still holds its initial weights
        return engine.unwrap(), contextlib.nullcontext()
    assert plan.reference == REFERENCE_MODEL and named is not None
    return named, contextlib.nullcontext()


def _score(
    plan: RunPlan, engine: Engine, named: torch.nn.Module | None, ds: PairDataset, env: DistEnv, pad_id: int
) -> np.ndarray:
    """[pairs, 4] float32: per pair (chosen sum, rejected sum, chosen count, rejected count).

    With sequence parallelism the batches are dealt to the sequence groups; every rank of a group
    scores its slice of the group's batch (``llmft.data.sequence``), the group sums the slices'
    sums and counts, and the group's first rank reports them."""
    layout = plan.layout
    n, size = len(ds), plan.batch.micro_batch_size
    batches = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
    mine = batches[layout.dp_rank(env.rank) :: layout.dp_size]
    rounds = -(-len(batches) // layout.dp_size)
    group = SequenceSlices(layout)
    model, scope = _reference_forward(plan, engine, named)
    disable_dropout(model)
    found: list[tuple[list[int], np.ndarray]] = []
    with torch.no_grad(), scope, engine.autocast():
        for r in range(rounds):
            idx = mine[r] if r < len(mine) else batches[0]  # every rank runs as many (collective) forwards
            batch = collate_pairs([ds.item(i, reference=False) for i in idx], pad_id)
            batch = rank_slice(batch, layout, env.rank)
            batch = {name: v.to(env.device) if isinstance(v, torch.Tensor) else v for name, v in batch.items()}
            sums, counts = model_sequence_logps(model, batch, 2 * len(idx))
            sums, counts = group.whole(sums), group.whole(counts)
            if r < len(mine) and group.first:
                rows = torch.stack([sums[0::2], sums[1::2], counts[0::2], counts[1::2]], 1)
                found.append((idx, rows.float().cpu().numpy()))
    if env.distributed and dist.is_initialized():
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, found)
        found = [f for part in gathered for f in part]
    values = np.zeros((n, 4), dtype=np.float32)
    for idx, rows in found:
        values[idx] = rows
    return values


# --- the files -----------------------------------------------------------------------------------


def _files(ds: PairDataset, key: str) -> tuple[Path, Path]:
    assert ds.path is not None
    folder = ds.path.parent / REFERENCE_DIR / key
    return folder / f"{ds.path.stem}.npy", folder / f"{ds.path.stem}.json"


def _load(ds: PairDataset, key: str) -> np.ndarray | None:
    """The stored log-probs of ``ds`` under ``key``, or None if absent or not whole."""
    if ds.path is None:
        return None
    npy, meta_path = _files(ds, key)
    try:
        meta = json.loads(meta_path.read_text())
        raw = npy.read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("crc32") != zlib.crc32(raw) or meta.get("pairs") != len(ds):
        log.warning("reference log-probs: %s does not match %s; computing them again", npy, meta_path)
        return None
    values = np.load(npy, allow_pickle=False)
    return values if values.shape == (len(ds), 4) and values.dtype == np.float32 else None


def _store(ds: PairDataset, key: str, parts: dict, values: np.ndarray, seconds: float, ranks: int) -> None:
    npy, meta_path = _files(ds, key)
    npy.parent.mkdir(parents=True, exist_ok=True)
    tmp = npy.with_suffix(f".tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, values, allow_pickle=False)
    raw = tmp.read_bytes()
    os.replace(tmp, npy)
    meta = {
        "pairs": len(ds),
        "crc32": zlib.crc32(raw),
        "parts": parts,
        "seconds": round(seconds, 2),
        "ranks": ranks,
        "llmft": llmft.__version__,
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    tmp_meta = meta_path.with_suffix(f".tmp-{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
    os.replace(tmp_meta, meta_path)  # last: the log-probs count only once their meta names them
