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
- ``check_ours``: a non-empty ``run.output_dir`` that is not an llmft run is refused, so a fresh
  run never writes into (or deletes from) a folder of the user's.
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

from llmft.checkpoint.layout import BASE_DIR, CHECKPOINTS, COMPLETE, LATEST, STEP_RE
from llmft.errors import Problem, UserError
from llmft.recipe.load import RECIPE_FILE

log = logging.getLogger("llmft")

LOCK_FILE = ".llmft.lock"
RUN_MARKER = ".llmft-run"  # written at a run's first start: this directory is an llmft run
METRICS_FILE = "metrics.jsonl"
# What may already sit in a run directory before its first run: llmft compile's default output.
BEFORE_FIRST_RUN = frozenset({LOCK_FILE, RUN_MARKER, "compiled"})


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
    """A directory llmft has run in: its marker, or (runs of older llmft versions) a checkpoints/
    folder with llmft step dirs, or the resolved recipe beside metrics.jsonl."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_MARKER).is_file():
        return True
    root = run_dir / CHECKPOINTS
    if root.is_dir() and any(STEP_RE.match(p.name) and (p / COMPLETE).is_file() for p in root.iterdir()):
        return True
    return (run_dir / RECIPE_FILE).is_file() and (run_dir / METRICS_FILE).is_file()


def check_ours(run_dir: Path) -> None:
    """Refuse a non-empty directory that is not an llmft run: llmft would write into it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or is_llmft_run(run_dir):
        return
    foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in BEFORE_FIRST_RUN)
    if not foreign:
        return
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    raise UserError(
        Problem(
            "run.output_dir",
            f"{run_dir} is not empty ({shown}) and is not an llmft run directory; llmft writes recipe.yaml, "
            "metrics.jsonl and checkpoints/ there and will not mix them with files it did not write",
            "Choose a new or empty run.output_dir (e.g. a subfolder of this one).",
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
