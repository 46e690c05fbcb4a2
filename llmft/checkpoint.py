"""Checkpoints on accumulation boundaries: step folders, completion marker, ``latest``, retention.

A checkpoint is written into ``checkpoints/.tmp-step-N`` by every rank, then,
after a barrier, rank 0 writes the ``COMPLETE`` marker and renames the folder to
``step-N`` (an atomic rename on one filesystem), then points ``latest`` at it
with another atomic rename. A process killed at any moment therefore leaves
either the new complete checkpoint or the previous one as ``latest``, never a
half-written folder under a ``step-N`` name.

Non-tensor state is JSON; tensors are safetensors or ``torch.save`` files that
are read back with ``weights_only=True`` (DeepSpeed's own files excepted: see
``llmft.consolidate``).

A DeepSpeed ZeRO 1-3 checkpoint resumed on another world size is converted once to
DeepSpeed's universal format (``deepspeed_universal``; also ``python -m llmft.checkpoint
universal CKPT``). docs/checkpoints.md describes the whole contract.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmft.dist import DistEnv, barrier, broadcast_object
from llmft.errors import Problem, UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
STEP_RE = re.compile(r"^step-(\d+)$")
# tests only: "kill_in_save:<step>[:<rank>]" SIGKILLs this process (or only that rank) mid-save
FAULT_ENV = "LLMFT_FAULT_INJECT"
UNIVERSAL_DIR = "deepspeed_universal"  # step-N/deepspeed_universal: a ZeRO checkpoint resharded for any dp size


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file() and not pointer.is_symlink():
        target = root / pointer.read_text().strip()
        if (target / COMPLETE).exists():
            return target
    dirs = step_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A ``step-N`` dir, ``checkpoints/latest``, ``checkpoints/``, or a run dir (its latest)."""
    p = Path(path)
    if p.name == LATEST and p.is_file():
        p = p.parent / p.read_text().strip()
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _maybe_fault(step: int, rank: int) -> None:
    kind, _, where = os.environ.get(FAULT_ENV, "").partition(":")
    at, _, only_rank = where.partition(":")
    if kind == "kill_in_save" and at == str(step) and only_rank in ("", str(rank)):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class CheckpointManager:
    def __init__(self, run_dir: Path, env: DistEnv, keep_last: int | None) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.env = env
        self.keep_last = keep_last
        self.protected: Path | None = None  # the checkpoint we resumed from is never pruned mid-run

    def save(
        self, step: int, engine, state: dict[str, Any], *, recipe_yaml: str, tokenizer, save_optimizer: bool
    ) -> Path:
        final = self.root / f"step-{step}"
        tmp = self.root / f".tmp-step-{step}"
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a killed save
            tmp.mkdir()
        barrier()
        engine.save(tmp, save_optimizer=save_optimizer)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank-{self.env.rank}.pt")
        if self.env.is_main:
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            (tmp / "recipe.yaml").write_text(recipe_yaml)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "tokenizer")
        _maybe_fault(step, self.env.rank)
        barrier()
        if self.env.is_main:
            _atomic_write(tmp / COMPLETE, json.dumps({"step": step}))
            if final.exists():  # re-running a step after resuming from an older checkpoint
                trash = self.root / f".trash-step-{step}"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write(self.root / LATEST, final.name)
            self.prune()
        barrier()
        return final

    def prune(self) -> None:
        if self.keep_last is None:
            return
        dirs = step_dirs(self.run_dir)
        for _, d in dirs[: max(len(dirs) - self.keep_last, 0)]:
            if self.protected is not None and d.resolve() == self.protected.resolve():
                continue
            shutil.rmtree(d, ignore_errors=True)

    def load_state(self, ckpt: Path) -> dict[str, Any]:
        state = json.loads((ckpt / STATE_FILE).read_text())
        rng_file = ckpt / "rng" / f"rank-{self.env.rank}.pt"
        state["_rng"] = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
        return state


# --- DeepSpeed universal checkpoints: ZeRO 1-3 state resharded for any data-parallel size ----------


def deepspeed_dp_size(step_dir: Path) -> int | None:
    """The data-parallel size a ZeRO 1-3 checkpoint is partitioned for (None: ZeRO-0 or no DeepSpeed state)."""
    from llmft.engines.deepspeed import DS_DIR, TAG

    pattern = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
    ranks = {
        m.group(1) for f in (Path(step_dir) / DS_DIR / TAG).glob("*_optim_states.pt") if (m := pattern.search(f.name))
    }
    return len(ranks) or None


def deepspeed_universal(step_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Convert a ZeRO 1-3 checkpoint into DeepSpeed's universal format, in this process.

    ZeRO partitions optimizer state (and, at stage 3, weights) by data-parallel rank, so
    DeepSpeed refuses to load it on another world size. Its ``ds_to_universal`` rewrites the
    partitions as one folder per parameter (fp32 weight, Adam moments), which an engine of any
    size loads with ``"checkpoint": {"load_universal": true}``. Written to
    ``step-N/deepspeed_universal/`` (or ``out``) by default, staged under a temporary name and
    renamed, so a crash mid-conversion leaves nothing half-made; an existing conversion is
    reused. The result is load_dir for ``engine.load_checkpoint(load_dir, tag="state")``.

    On demand: ``python -m llmft.checkpoint universal CHECKPOINT``. A resume on another world
    size calls it on rank 0 by itself (``DeepSpeedEngineAdapter.load``).
    """
    import argparse
    import contextlib
    import io

    from llmft.engines.deepspeed import DS_DIR, TAG

    step_dir = resolve_checkpoint(step_dir)
    out = Path(out) if out is not None else step_dir / UNIVERSAL_DIR
    if (out / TAG / "zero").is_dir():
        return out
    if deepspeed_dp_size(step_dir) is None:
        raise UserError(
            Problem(
                str(step_dir),
                "holds no DeepSpeed ZeRO 1-3 optimizer partitions, so there is nothing to convert "
                "(ZeRO-0, FSDP and single-process checkpoints load on any world size as they are)",
                "Pass a checkpoint written with distributed.engine=deepspeed and zero_stage 1-3.",
            )
        )
    from deepspeed.checkpoint import ds_to_universal

    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed conversion
    tmp.mkdir(parents=True)
    args = argparse.Namespace(
        input_folder=str(step_dir / DS_DIR / TAG),
        output_folder=str(tmp / TAG),  # ds_to_universal also writes latest_universal beside it, inside tmp
        num_extract_workers=1,  # in this process: no worker pool to fork from a training process
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # checkpoints saved without UNIVERSAL_CHECKPOINT_INFO (older llmft)
    )
    chatter = io.StringIO()  # its prints and progress bars
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # converted meanwhile by someone else: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    return out


def universal_for_resume(step_dir: Path, env: DistEnv) -> Path:
    """Rank 0 converts (or reuses) ``step-N/deepspeed_universal``; every rank waits and gets its path."""
    error = None
    if env.is_main:
        try:
            deepspeed_universal(step_dir)
        except Exception as e:  # every rank must learn of it, not wait in a barrier forever
            error = f"{type(e).__name__}: {e}"
    error = broadcast_object(error)
    if error is not None:
        raise UserError(
            Problem(
                str(step_dir),
                f"was written on another world size and could not be converted to DeepSpeed's universal "
                f"checkpoint ({error})",
                "Resume on the world size that wrote it, or convert it by hand with "
                f"`python -m llmft.checkpoint universal {step_dir}` to see the full error.",
            )
        )
    return step_dir / UNIVERSAL_DIR


def main(argv: list[str] | None = None) -> int:
    """``python -m llmft.checkpoint universal CHECKPOINT [--out DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m llmft.checkpoint",
        description="Checkpoint tools. universal: convert a DeepSpeed ZeRO 1-3 checkpoint to DeepSpeed's "
        "universal format (what a resume on another world size loads; done automatically on resume).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("universal", help="convert a ZeRO 1-3 checkpoint to DeepSpeed's universal format")
    p.add_argument("checkpoint", help="checkpoints/step-N, checkpoints/latest, or a run directory (its latest)")
    p.add_argument("--out", default=None, help="output directory (default: <step-N>/deepspeed_universal)")
    args = parser.parse_args(argv)
    try:
        print(deepspeed_universal(args.checkpoint, args.out))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
