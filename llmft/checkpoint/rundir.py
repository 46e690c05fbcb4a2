"""One writer per run directory, and only llmft's own files touched (docs/design.md, G8).

- ``RunDirLock``: an exclusive ``fcntl.flock`` on ``<run>/.llmft.lock``, held by rank 0 for the
  whole run. The kernel releases it when the process ends, however it ends (kill -9 included), so
  a stale lock never blocks a requeue; a second ``llmft train`` on the same directory gets a clear
  error naming the process that holds it. (``flock`` on NFS / Lustre works where the mount supports
  it; where it does not, two jobs are not kept apart: docs/checkpoints.md.)
  A ``flock`` belongs to the open file, not the process: a forked child (a DataLoader worker, a
  tokenizing pool) would share it and keep the directory locked after the OOM killer's kill -9 of
  the trainer. So the lock's descriptor is closed in every child right after the fork
  (``os.register_at_fork``) and on exec (``O_CLOEXEC``): only the process that took it holds it.
- ``check_ours``: a non-empty ``run.output_dir`` that is not an llmft run is refused, so a run
  never writes into (or deletes from) a folder of the user's, unless ``run.overwrite=true`` says
  to take it over. An llmft run is a folder with the run marker (``.llmft-run``), or, written by
  an llmft older than the marker, one with a complete checkpoint (``checkpoints/step-N/`` whose
  ``COMPLETE`` marker holds ``{"step": N}``), or a ``recipe.yaml`` that is a resolved recipe
  as llmft writes it beside a ``metrics.jsonl`` whose rows are llmft's. Two files of those names
  alone are not: a folder of the user's may hold them.
- ``clear_for_fresh_start``: ``run.overwrite=true`` removes llmft's own entries only, each logged.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import yaml

from llmft.checkpoint.layout import BASE_DIR, CHECKPOINTS, COMPLETE, LATEST, STEP_RE
from llmft.errors import Problem, UserError
from llmft.recipe.load import RECIPE_FILE

log = logging.getLogger("llmft")

LOCK_FILE = ".llmft.lock"
RUN_MARKER = ".llmft-run"  # written at a run's first start: this directory is an llmft run
METRICS_FILE = "metrics.jsonl"
# What may already sit in a run directory before its first run: llmft compile's default output.
BEFORE_FIRST_RUN = frozenset({LOCK_FILE, RUN_MARKER, "compiled"})
# What llmft train replaces or adds to in a run directory (itself and its trackers): in a folder
# without the marker, these names are the user's until they say otherwise. (The run's metrics.png
# and llmft export's exported/ are refused where a file of the user's is in the way: metrics/plot.py,
# export/export.py.)
OWN_NAMES = (RECIPE_FILE, METRICS_FILE, CHECKPOINTS, "trackers.json", "tensorboard", "wandb")
# How much of a marker-less folder's recipe.yaml and metrics.jsonl is read to tell whether llmft
# wrote them: a resolved recipe is a few KiB, a metrics row a few hundred bytes.
EVIDENCE_BYTES = 1 << 20
EVIDENCE_ROWS = 64
# The sections every recipe.yaml llmft writes has (the whole resolved recipe is dumped).
_RECIPE_SECTIONS = ("run", "model", "data", "batch", "distributed", "optim", "train", "checkpoint")


# Descriptors of the run locks this process holds: closed in a forked child (see the module doc).
_held: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _held:
        try:
            os.close(fd)  # the parent's descriptor stays open: its lock is untouched
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunDirLock:
    """Exclusive ownership of a run directory for this process's lifetime (rank 0 holds it)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(
                Problem(
                    "run.output_dir",
                    f"cannot create {self.path} ({e.strerror or e}); llmft writes its lock, recipe, metrics and "
                    "checkpoints there",
                    "Give run.output_dir a directory this user can write to (not a read-only mount).",
                )
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd, self.path)
            os.close(fd)
            raise UserError(
                Problem(
                    "run.output_dir",
                    f"{self.path.parent} is in use by another llmft train ({holder}); two runs in one "
                    "directory would interleave their checkpoints and metrics",
                    "Wait for that run to end (or stop it), or give this one another run.output_dir.",
                )
            ) from None
        _held.add(fd)
        os.ftruncate(fd, 0)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv[:4]),
        }
        os.write(fd, (json.dumps(info) + "\n").encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            _held.discard(self._fd)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _read_holder(fd: int, path: Path) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        holder = f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "a process that left no details"
    if info["host"] == socket.gethostname() and not _alive(info["pid"]):
        # An llmft older than this lock's fork rule: a child of the dead holder still has it open.
        holder += f"; that process has exited, but a process it started still holds the lock (`fuser {path}` names it)"
    return holder


def _alive(pid: object) -> bool:
    try:
        os.kill(int(pid), 0)  # type: ignore[call-overload]
    except ProcessLookupError:
        return False
    except (OSError, ValueError, TypeError):
        return True  # another user's process, or not a pid: do not claim it is gone
    return True


def is_llmft_run(run_dir: Path) -> bool:
    """A directory llmft has run in: its marker, or (runs of llmft versions older than the marker)
    a complete checkpoint, or the resolved recipe llmft writes beside metrics rows llmft wrote."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_MARKER).is_file():
        return True
    return bool(complete_checkpoints(run_dir)) or (
        _is_resolved_recipe(run_dir / RECIPE_FILE) and _is_llmft_metrics(run_dir / METRICS_FILE)
    )


def complete_checkpoints(run_dir: Path) -> list[str]:
    """Names of ``checkpoints/step-N`` folders with llmft's ``COMPLETE`` marker, as every llmft
    version wrote it: the JSON ``{"step": N}`` of its own folder."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted(p.name for p in root.iterdir() if _marked_complete(p))


def _marked_complete(step_dir: Path) -> bool:
    m = STEP_RE.match(step_dir.name)
    if m is None or step_dir.is_symlink() or not step_dir.is_dir():
        return False
    text = _head(step_dir / COMPLETE)
    try:
        return text is not None and json.loads(text) == {"step": int(m.group(1))}
    except (ValueError, RecursionError):
        return False


def _head(path: Path) -> str | None:
    """The first ``EVIDENCE_BYTES`` of a regular file as text, or None (absent, a link, not UTF-8)."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            return f.read(EVIDENCE_BYTES).decode()
    except (OSError, UnicodeDecodeError):
        return None


def _is_resolved_recipe(path: Path) -> bool:
    """``recipe.yaml`` as llmft writes it into a run: every section, decisions written in (the three
    batch numbers, a concrete engine)."""
    text = _head(path)
    if text is None or len(text) >= EVIDENCE_BYTES:
        return False
    try:
        data: Any = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError):
        return False
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in _RECIPE_SECTIONS):
        return False
    batch, engine = data["batch"], data["distributed"].get("engine")
    numbers = [batch.get(k) for k in ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")]
    return (
        all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers)
        and isinstance(engine, str)
        and engine != "auto"
        and isinstance(data["run"].get("output_dir"), str)
    )


def _is_llmft_metrics(path: Path) -> bool:
    """``metrics.jsonl`` whose first rows are llmft's: JSON objects with an integer ``step`` and a
    ``split`` of ``train`` (with ``loss`` and ``lr``) or ``eval``; a torn last line is allowed."""
    text = _head(path)
    if not text:
        return False
    lines = [line for line in text.splitlines()[:EVIDENCE_ROWS] if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except (ValueError, RecursionError):
            if i == len(lines) - 1 and rows:  # a run killed mid-write, or the end of what was read
                break
            return False
    train = 0
    for row in rows:
        if not isinstance(row, dict) or type(row.get("step")) is not int or row.get("split") not in ("train", "eval"):
            return False
        if row["split"] == "train":
            if not {"loss", "lr"} <= row.keys():
                return False
            train += 1
    return train > 0


def check_ours(run_dir: Path, overwrite: bool = False) -> bool:
    """Refuse a non-empty directory that is not an llmft run: llmft would write into it.

    ``overwrite`` (``run.overwrite=true``): the user hands the folder to llmft; it is taken over
    (logged), and True is returned: the caller starts fresh there, replacing llmft's names only."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or is_llmft_run(run_dir):
        return False
    entries = sorted(p.name for p in run_dir.iterdir() if p.name not in BEFORE_FIRST_RUN)
    if not entries:
        return False
    shown = ", ".join(entries[:8]) + (f", ... ({len(entries)} entries)" if len(entries) > 8 else "")
    taken = [n for n in OWN_NAMES if n in entries]
    if overwrite:
        log.warning(
            "run.overwrite=true: taking over %s, which is not an llmft run (it holds %s); llmft writes its own "
            "files there%s and leaves every other file as it is",
            run_dir,
            shown,
            f", replacing or adding to your {', '.join(taken)}" if taken else "",
        )
        return True
    what = (
        f"llmft would replace or add to {', '.join(taken)} there"
        if taken
        else f"llmft would write {RECIPE_FILE}, {METRICS_FILE} and {CHECKPOINTS}/ among these files"
    )
    raise UserError(
        Problem(
            "run.output_dir",
            f"{run_dir} is not empty ({shown}) and is not an llmft run directory (no {RUN_MARKER} marker, no "
            f"complete checkpoint, no {RECIPE_FILE} and {METRICS_FILE} that llmft wrote); {what}",
            "Choose a new or empty run.output_dir (e.g. a subfolder of this one). If this folder is yours to "
            f"hand over, set run.overwrite=true: llmft then writes its own {RECIPE_FILE}, {METRICS_FILE} and "
            f"{CHECKPOINTS}/ there (replacing those names) and leaves every other file as it is. If it is an "
            f"llmft run whose marker was lost, `touch {run_dir / RUN_MARKER}` to continue it as it is.",
        )
    )


def mark(run_dir: Path) -> None:
    path = Path(run_dir) / RUN_MARKER
    try:
        path.write_text("This directory is an llmft run (see docs/checkpoints.md).\n")
    except OSError as e:
        raise UserError(
            Problem(
                "run.output_dir",
                f"cannot write {path} ({e.strerror or e})",
                "Give run.output_dir a directory this user can write to, with free space.",
            )
        ) from None


def own_checkpoint_entries(run_dir: Path) -> list[Path]:
    """llmft's entries in ``checkpoints/``: step dirs, interrupted ones, ``latest``, the saved base."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        name = p.name
        if STEP_RE.match(name) or name in (LATEST, BASE_DIR, f".{LATEST}.tmp"):
            out.append(p)
        elif name.startswith((".tmp-step-", ".trash-step-")) and STEP_RE.match(name.split("-", 1)[1]):
            out.append(p)
    return out


def clear_for_fresh_start(run_dir: Path) -> None:
    """``run.overwrite=true``: remove llmft's checkpoints and metrics of the earlier run, nothing else."""
    for p in [*own_checkpoint_entries(run_dir), Path(run_dir) / METRICS_FILE, Path(run_dir) / "trackers.json"]:
        if not p.exists() and not p.is_symlink():
            continue
        log.warning("run.overwrite=true: removing %s", p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
