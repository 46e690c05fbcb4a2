"""Writing checkpoints on accumulation boundaries: atomic step folders, ``latest``, retention, RNG.

A checkpoint is written into ``checkpoints/.tmp-step-N`` by every rank, then,
after a barrier, rank 0 writes the ``COMPLETE`` marker and renames the folder to
``step-N`` (an atomic rename on one filesystem), then points ``latest`` at it
with another atomic rename. A process killed at any moment therefore leaves
either the new complete checkpoint or the previous one as ``latest``, never a
half-written folder under a ``step-N`` name.

The engine writes the model and optimizer part in its own format (``engines/``);
this module writes everything else. Non-tensor state is JSON; RNG states are
``torch.save`` files read back with ``weights_only=True``. docs/checkpoints.md
describes the whole contract.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from llmft.checkpoint.layout import (
    CHECKPOINTS,
    COMPLETE,
    LATEST,
    STATE_FILE,
    TOKENIZER_DIR,
    TrainerState,
    atomic_write,
    fsync_dir,
    manifest,
    objective_file,
    objective_files,
    rng_file,
    step_dirs,
    step_name,
    tmp_name,
)
from llmft.checkpoint.safe_load import torch_load
from llmft.errors import Problem, UserError
from llmft.job.dist import DistEnv, all_reduce_sum, barrier
from llmft.plan.resolve import PLAN_FILE
from llmft.recipe.load import RECIPE_FILE

if TYPE_CHECKING:  # the engines import checkpoint.layout: a real import would be a package cycle
    from llmft.engines import Engine


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, quota, I/O error). Distinct from a divergence."""

    exit_code = 74  # EX_IOERR


def _write_error(e: BaseException) -> OSError | None:
    """The OS error behind a failed write (DCP wraps each rank's in a CheckpointException)."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError":  # safetensors' Rust writer reports "... (os error N)"
        found = re.search(r"os error (\d+)", str(e))
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
    for failure in getattr(e, "failures", {}).values():  # torch.distributed.checkpoint.api.CheckpointException
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError):
            return inner
    return None


def _remove(path: Path) -> None:
    """A folder, or a link (refused as a checkpoint: it is removed, never what it points to)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class SavedState(dict):
    """One rank's objective state as loaded, with the file it came from (``path``), so that an
    objective that finds it wrong names the file."""

    def __init__(self, path: Path, state: dict[str, Any]) -> None:
        super().__init__(state)
        self.path = Path(path)


def _state_mapping(path: Path, state: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise UserError(
            Problem(
                str(path),
                f"is damaged: holds a {type(state).__name__}, not an objective state (a mapping of named values)",
                "Resume from an earlier checkpoint (checkpoint.resume=auto skips damaged ones), or restore the file.",
            )
        )
    return state


@dataclass
class SaveHooks:
    """Test instrumentation: ``before_commit(step, rank)`` runs when this rank has written its part
    of step ``step`` and before the checkpoint is committed (a test kills the process there)."""

    before_commit: Callable[[int, int], None] = lambda step, rank: None


class CheckpointManager:
    """Owns ``checkpoints/``: atomic step folders, ``latest``, retention."""

    def __init__(self, run_dir: Path, env: DistEnv, keep_last: int | None, hooks: SaveHooks | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.env = env
        self.keep_last = keep_last
        self.hooks = hooks or SaveHooks()
        self.protected: Path | None = None  # the checkpoint we resumed from is never pruned mid-run

    def save(
        self,
        state: TrainerState,
        engine: Engine,
        *,
        recipe_yaml: str,
        plan_yaml: str,
        tokenizer,
        save_optimizer: bool,
        objective_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write step ``state.step``: ``recipe_yaml`` is the run's intent, ``plan_yaml`` its decisions,
        ``objective_state`` this rank's part of the objective's own state (``Objective.state_dict``)."""
        step = state.step
        final = self.root / step_name(step)
        tmp = self.root / tmp_name(step)
        failed: OSError | None = None
        if self.env.is_main:
            try:  # a read-only or full run dir fails here: the other ranks then fail to write into tmp
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)  # left by a killed save
                tmp.mkdir()
            except OSError as e:
                failed = e
        barrier()
        try:
            if failed is None:
                texts = {RECIPE_FILE: recipe_yaml, PLAN_FILE: plan_yaml}
                self._write(tmp, state, engine, texts=texts, tokenizer=tokenizer, save_optimizer=save_optimizer)
                if objective_state is not None:
                    path = objective_file(tmp, self.env.rank)
                    path.parent.mkdir(exist_ok=True)
                    torch.save(objective_state, path)
        except Exception as e:  # noqa: BLE001 - only write errors are ours to report; the rest re-raise below
            failed = _write_error(e)
            if failed is None:
                raise
        self.hooks.before_commit(step, self.env.rank)
        (failures,) = all_reduce_sum([1.0 if failed else 0.0], self.env.device)  # every rank learns of it
        if failures:
            raise self._abandon(tmp, step, failed)
        barrier()
        if self.env.is_main:
            try:
                self._commit(tmp, final, step)
            except OSError as e:  # every rank learns of it below, none waits in a barrier for rank 0
                failed = e
        (failures,) = all_reduce_sum([1.0 if failed else 0.0], self.env.device)
        if failures:
            raise self._abandon(tmp, step, failed)
        return final

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: the marker (with the manifest of what every rank wrote), the rename to ``step-N``,
        ``latest``, pruning."""
        atomic_write(tmp / COMPLETE, json.dumps({"step": step, "files": manifest(tmp)}))
        if final.exists():  # re-running a step after resuming from an older checkpoint
            trash = self.root / f".trash-{step_name(step)}"
            _remove(trash)
            os.replace(final, trash)
            _remove(trash)
        os.replace(tmp, final)
        fsync_dir(self.root)
        atomic_write(self.root / LATEST, final.name)
        self.prune()

    def _write(
        self, tmp: Path, state: TrainerState, engine: Engine, *, texts: dict[str, str], tokenizer, save_optimizer: bool
    ):
        engine.save(tmp, save_optimizer=save_optimizer)
        rng = rng_file(tmp, self.env.rank)
        rng.parent.mkdir(exist_ok=True)
        torch.save(rng_state(), rng)
        if self.env.is_main:
            (tmp / STATE_FILE).write_text(state.to_json())
            for name, text in texts.items():
                (tmp / name).write_text(text)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / TOKENIZER_DIR)

    def _abandon(self, tmp: Path, step: int, failed: OSError | None) -> CheckpointWriteError:
        """Remove the half-written ``.tmp-step-N``; ``latest`` and the earlier checkpoints were never touched."""
        barrier()
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(self.root).free if self.root.is_dir() else 0
        previous = step_dirs(self.run_dir)
        what = (
            f"{failed.strerror or failed} ({failed.filename or tmp})"
            if failed is not None
            else "another rank could not write its part"
        )
        return CheckpointWriteError(
            Problem(
                str(tmp),
                f"writing the checkpoint of step {step} failed: {what}; {free / 2**30:.2f} GiB free there. "
                "The partial checkpoint was removed; "
                + (f"{previous[-1][1].name} and latest are untouched" if previous else "no earlier checkpoint exists"),
                "Free disk space or quota (or point run.output_dir at a larger disk), then run the same command: "
                "it resumes from the newest complete checkpoint.",
            )
        )

    def prune(self) -> None:
        if self.keep_last is None:
            return
        dirs = step_dirs(self.run_dir)
        for _, d in dirs[: max(len(dirs) - self.keep_last, 0)]:
            if self.protected is not None and d.resolve() == self.protected.resolve():
                continue
            shutil.rmtree(d, ignore_errors=True)

    def load_objective_states(self, step_dir: Path) -> list[SavedState]:
        """Every rank's objective state in ``step_dir`` (all of them: a resume on another world size
        takes what its ranks need), in rank order; empty when the objective saved none."""
        return [SavedState(path, _state_mapping(path, torch_load(path))) for path in objective_files(step_dir)]

    def load_rng(self, step_dir: Path) -> dict[str, Any] | None:
        """This rank's RNG state in ``step_dir`` (None when that rank did not exist then)."""
        path = rng_file(step_dir, self.env.rank)
        return torch_load(path) if path.exists() else None  # weights_only; a refusal names the file
