"""Every name in a run directory's ``checkpoints/``, the trainer state, and how a checkpoint is found.

::

    <run.output_dir>/
      recipe.yaml                 the resolved recipe of the run
      metrics.jsonl
      checkpoints/
        latest                    a file holding the name of the newest complete step dir
        base_model/               model.config + PEFT: the random base, written once (export needs it)
        step-<N>/                 complete (COMPLETE marker) or absent; written as .tmp-step-<N>
          COMPLETE                JSON {"step": N, "files": {path: [size, fingerprint]}}, written last
          trainer_state.json      TrainerState
          recipe.yaml             the recipe of the run that wrote it, as given (its intent)
          plan.yaml               the decisions taken for it: engine, world, batch (absent in older checkpoints)
          tokenizer/              tokenizer.save_pretrained
          rng/rank-<R>.pt         RNG state of each rank (torch.load weights_only)
          model/                  single / DDP: save_pretrained (PEFT adapter dir or full model dir)
          optimizer.pt            single / DDP: optimizer state dict (weights_only)
          dcp/                    FSDP2: torch.distributed.checkpoint of model (+ optimizer)
          deepspeed/state/        DeepSpeed ZeRO 0-3: DeepSpeed's own files
          deepspeed_universal/    ZeRO 1-3 converted for another world size (made on demand)
          objective/rank-<R>.pt   the objective's own state of each rank that kept one (weights_only)

Each engine owns the format of its part (``engines/``); the names are here. Pure: no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from llmft.errors import Problem, UserError
from llmft.plan.batch import BatchPlan

# The two files a compiled dir and a checkpoint share, defined where llmft compile writes them:
# named here (explicit re-exports) beside every other name of a checkpoint.
from llmft.recipe.load import RECIPE_FILE  # the recipe as given

log = logging.getLogger("llmft")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
TOKENIZER_DIR = "tokenizer"
RNG_DIR = "rng"
OBJECTIVE_DIR = "objective"  # an objective's own state per rank (online RL: the kept generation batch)
BASE_DIR = "base_model"  # beside the step dirs, so pruning never removes it
COMPLETIONS_DIR = "completions"  # <run>/completions/rank-<r>.jsonl: rollout.save_completions
EXPORTS = "exported"  # <run>/exported/step-N: llmft export's default output
# single / DDP
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# FSDP2
DCP_DIR = "dcp"
# DeepSpeed: deepspeed/<tag>/...; universal conversions in deepspeed_universal/<tag>/
DS_DIR = "deepspeed"
DS_TAG = "state"
UNIVERSAL_DIR = "deepspeed_universal"

STEP_RE = re.compile(r"^step-(\d+)$")
RANK_FILE_RE = re.compile(r"^rank-(0|[1-9]\d*)\.pt$")  # rng/ and objective/: one file per rank


def step_name(step: int) -> str:
    return f"step-{step}"


def tmp_name(step: int) -> str:
    """Where step ``step`` is written before it is complete."""
    return f".tmp-{step_name(step)}"


def rng_file(step_dir: Path, rank: int) -> Path:
    return Path(step_dir) / RNG_DIR / f"rank-{rank}.pt"


def objective_file(step_dir: Path, rank: int) -> Path:
    return Path(step_dir) / OBJECTIVE_DIR / f"rank-{rank}.pt"


def rank_of(path: Path) -> int | None:
    """R of a ``rank-<R>.pt`` name, None for any other name (``rank-0.bak.pt``, ``rank-00.pt``)."""
    m = RANK_FILE_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


# --- the manifest: what a step dir held when it was saved ---------------------------------------

# Written after the save, on purpose, so not part of what was saved.
NOT_IN_MANIFEST = (UNIVERSAL_DIR,)
WHOLE_UP_TO = 1 << 20  # files up to this size are fingerprinted whole
SAMPLE = 1 << 16  # larger ones: their first and last SAMPLE bytes and SAMPLES blocks between
SAMPLES = 16


def fingerprint(path: Path) -> str:
    """sha256 of a file (up to ``WHOLE_UP_TO`` bytes) or of samples of it spread over its length: a
    constant amount of reading per file, which tells a file from one of an earlier step or another
    run (an optimizer step changes every block of the weights and the optimizer state)."""
    size = Path(path).stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= WHOLE_UP_TO:
            digest.update(f.read())
        else:
            for i in range(SAMPLES + 2):
                f.seek(min(i * (size - SAMPLE) // (SAMPLES + 1), size - SAMPLE))
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()[:32]


def manifest(step_dir: Path) -> dict[str, list]:
    """``{relative path: [size, fingerprint]}`` of every file of ``step_dir`` but its marker."""
    step_dir = Path(step_dir)
    out = {}
    for folder, dirs, names in os.walk(step_dir):
        dirs[:] = sorted(d for d in dirs if Path(folder) != step_dir or d not in NOT_IN_MANIFEST)
        for name in sorted(names):
            path = Path(folder) / name
            rel = path.relative_to(step_dir).as_posix()
            if rel != COMPLETE and not (Path(folder) == step_dir and name.startswith(f".{COMPLETE}")):
                out[rel] = [path.stat().st_size, fingerprint(path)]
    return out


def read_manifest(step_dir: Path) -> dict[str, list] | None:
    """The manifest in ``step_dir``'s marker; None for a checkpoint saved before there was one (or a
    marker that does not hold one: ``verify.check_checkpoint`` judges the marker itself)."""
    try:
        files = json.loads((Path(step_dir) / COMPLETE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return files if isinstance(files, dict) else None


def objective_files(step_dir: Path) -> list[Path]:
    """The objective state files of ``step_dir`` in rank order: those its manifest lists, or, in a
    checkpoint saved before the manifest, every ``objective/rank-<R>.pt`` (other names are never
    read; ``verify.check_checkpoint`` refuses or names them)."""
    step_dir = Path(step_dir)
    listed = read_manifest(step_dir)
    if listed is not None:
        paths = [step_dir / rel for rel in listed if rel.startswith(f"{OBJECTIVE_DIR}/")]
    else:
        folder = step_dir / OBJECTIVE_DIR
        paths = sorted(folder.iterdir()) if folder.is_dir() else []
    return sorted((p for p in paths if p.parent.name == OBJECTIVE_DIR and rank_of(p) is not None), key=rank_of)


# --- writing: a file or folder is whole or absent -----------------------------------------------


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class TrainerState:
    """Where training stands at a checkpoint: written to ``trainer_state.json`` and read back here only."""

    step: int  # optimizer steps done
    samples: int  # position in the global sample order
    tokens: int  # target tokens trained on
    epoch: float
    world_size: int  # processes that wrote the checkpoint
    engine: str
    batch: BatchPlan | None  # the batch that wrote it (None: a hand-made state without one)
    scheduler: dict[str, Any]  # the LR scheduler's state_dict
    versions: dict[str, str] = field(default_factory=dict)  # llmft, torch, transformers, ...
    trackers: dict[str, Any] = field(default_factory=dict)  # experiment trackers' run ids
    data: dict[str, Any] = field(default_factory=dict)  # data-side position (streaming sources)
    # per training source: what it holds (records, tokens, target tokens, rows) and its weight; model cards
    data_sources: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # keys of a newer llmft, kept as they were

    def to_json(self) -> str:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["batch"] = self.batch.to_dict() if self.batch is not None else {}
        extra = state.pop("extra")
        return json.dumps({**extra, **state}, indent=1)

    @classmethod
    def read(cls, step_dir: Path) -> TrainerState:
        """The state of ``step_dir``, type-checked: a field of the wrong JSON type is met here, with
        its name, not later as a ``None`` in the sampler or the scheduler."""
        path = Path(step_dir) / STATE_FILE
        try:
            raw = json.loads(path.read_text())
            _check_state_fields(raw)
            batch = BatchPlan.from_dict(raw["batch"]) if raw["batch"] else None
        except (OSError, ValueError, TypeError, KeyError) as e:
            what = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise UserError(
                Problem(
                    str(path),
                    f"cannot be read as llmft trainer state ({type(e).__name__}: {what})",
                    "Pass a checkpoints/step-N directory written by llmft train, or an older complete checkpoint.",
                )
            ) from None
        known = {f.name for f in fields(cls)} - {"extra", "batch"}
        return cls(
            **{k: v for k, v in raw.items() if k in known},
            batch=batch,
            extra={k: v for k, v in raw.items() if k not in known | {"batch"}},
        )


# The JSON type of each field ``TrainerState`` reads (``bool`` is not a number here: ``true`` would
# otherwise pass as step 1). Counts are whole and not negative; at least one process wrote it.
_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "samples": int,
    "tokens": int,
    "epoch": (int, float),
    "world_size": int,
    "engine": str,
    "batch": dict,
    "scheduler": dict,
    "versions": dict,
    "trackers": dict,
    "data": dict,
    "data_sources": list,
}
_REQUIRED = ("step", "samples", "tokens", "epoch", "world_size", "engine", "batch", "scheduler")


def _check_state_fields(raw: Any) -> None:
    """Raise ``ValueError`` naming the first field of ``raw`` that is not what llmft writes."""
    if not isinstance(raw, dict):
        raise ValueError(f"holds a JSON {type(raw).__name__}, not an object of named fields")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"lacks the field(s) {', '.join(missing)}")
    for key, kind in _STATE_TYPES.items():
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(f"field {key!r} is {json.dumps(value)[:40]}, not a JSON {names}")
        if kind is int and value < (1 if key == "world_size" else 0):
            raise ValueError(f"field {key!r} is {value}, below {1 if key == 'world_size' else 0}")


def saved_recipe(step_dir: Path) -> dict[str, Any]:
    """A checkpoint's ``recipe.yaml`` as plain values, each ``${...}`` resolved where it can be. One
    that cannot (an ``${oc.env:VAR}`` unset in this environment: recipes keep secrets as written)
    stays as its text, so a comparison names it instead of failing on it."""

    def lenient(node: Any) -> Any:
        if not isinstance(node, (DictConfig, ListConfig)):
            return node
        raw = OmegaConf.to_container(node, resolve=False)
        keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
        out = [] if isinstance(node, ListConfig) else {}
        for k in keys:
            try:
                value = lenient(node[k])
            except Exception:  # noqa: BLE001 - omegaconf's resolution errors have no common public base
                value = raw[k]
            out.append(value) if isinstance(out, list) else out.__setitem__(k, value)
        return out

    return lenient(OmegaConf.load(Path(step_dir) / RECIPE_FILE))


def saved_optimizer(step_dir: Path) -> str | None:
    """``optim.name`` of the run that wrote ``step_dir`` (None where its recipe does not say)."""
    optim = saved_recipe(step_dir).get("optim")
    return optim.get("name") if isinstance(optim, dict) else None


# --- finding checkpoints ------------------------------------------------------------------------


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if m and d.is_dir() and (d / COMPLETE).exists():
            found.append((int(m.group(1)), d))
    return sorted(found)


def read_latest(root: Path) -> str | None:
    """The step name ``checkpoints/latest`` holds (a file, or a symlink's target name), or None.

    Raises ``UserError`` when it holds anything but a ``step-N`` name: ``latest`` is a name inside
    this ``checkpoints/``, never a path (an absolute path or ``..`` would lead a resume or an export
    outside the run)."""
    pointer = Path(root) / LATEST
    if pointer.is_symlink():
        name = os.readlink(pointer)
    elif pointer.is_file():
        name = pointer.read_text().strip()
    else:
        return None
    if not STEP_RE.match(name):
        raise UserError(
            Problem(
                str(pointer),
                f"holds {name[:80]!r}, not a step-N name of a checkpoint in {pointer.parent}",
                "Delete it (llmft then uses the newest complete step-N), or pass a checkpoints/step-N directory.",
            )
        )
    return name


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``step-N`` of a run. ``latest`` only confirms it: a stale or invalid
    pointer is logged and ignored (the newest complete checkpoint is what was written last)."""
    root = Path(run_dir) / CHECKPOINTS
    dirs = step_dirs(run_dir)
    newest = dirs[-1][1] if dirs else None
    try:
        named = read_latest(root)
    except UserError as e:
        log.warning("%s; ignoring it", e)
        return newest
    if newest is not None and named is not None and named != newest.name:
        log.warning(
            "checkpoints/latest names %s, but %s is the newest complete checkpoint: using %s",
            named,
            newest.name,
            newest.name,
        )
    return newest


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A ``step-N`` dir, ``checkpoints/latest``, ``checkpoints/``, or a run dir (its latest)."""
    p = Path(path)
    if p.name == LATEST and (p.is_file() or p.is_symlink()):
        p = p.parent / read_latest(p.parent)
    if (p / COMPLETE).exists():
        return p
    if p.is_dir() and STEP_RE.match(p.name):
        raise UserError(
            Problem(
                str(p),
                "is an incomplete checkpoint (no COMPLETE marker: its save was interrupted)",
                "Use an older checkpoint, or the run dir to pick its newest complete one.",
            )
        )
    for run in (p, p.parent):
        found = latest_checkpoint(run) if (run / CHECKPOINTS).is_dir() else None
        if found is not None:
            return found
    raise UserError(
        Problem(
            str(p),
            "no complete checkpoint found here",
            "Pass a checkpoints/step-N directory, checkpoints/latest, or a run directory that has checkpoints.",
        )
    )
