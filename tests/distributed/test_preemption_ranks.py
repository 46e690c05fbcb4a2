"""Preemption of a multi-process job with the defaults (docs/design.md G3): the whole
process group of the launcher (launcher, both ranks and their DataLoader workers) gets SIGTERM,
as a scheduler sends it; every rank finishes the step, the checkpoint is written on a boundary,
every rank exits 75, and the run resumes to the uninterrupted run's losses.

torchrun is tested for each engine (DDP in the default suite, the others ``slow``), and the
deepspeed launcher once. srun cannot run here (no SLURM); under srun every rank is a task in
the job's step and gets the signal the same way (docs/multinode.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, free_port, metrics, torchrun, torchrun_cmd, wait_for_step, write_data, write_recipe

pytestmark = pytest.mark.distributed

STEPS = 8
ENGINES = {
    "ddp": {"distributed__engine": "ddp"},
    "fsdp": {"distributed__engine": "fsdp"},
    "zero2": {"distributed__engine": "deepspeed", "distributed__zero_stage": 2},
}


def _recipe(root: Path, engine: dict) -> Path:
    write_data(root / "train.jsonl", n=64)
    return write_recipe(
        root,
        **{
            "batch__global_batch_size": 8,
            "batch__micro_batch_size": 2,  # accumulation 2 on 2 ranks
            "data__num_workers": 1,  # the default: one DataLoader worker per rank
            "train__max_steps": STEPS,
            "checkpoint__every_steps": None,  # the only mid-run checkpoint is the one the stop writes
            **engine,
        },
    )


def _killpg_after_step_2(cmd: list[str], run_dir: Path) -> tuple[int, str]:
    """Start ``cmd`` in a new session, SIGTERM its whole process group after step 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        wait_for_step(run_dir, 2, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out + err


def _assert_stopped_on_a_boundary(run: Path, log: str) -> int:
    assert "is killed by signal" not in log, log[-4000:]
    stop = int((run / "checkpoints/latest").read_text().strip().removeprefix("step-"))
    assert 2 <= stop < STEPS, log[-4000:]
    assert (run / f"checkpoints/step-{stop}/COMPLETE").exists()
    assert max(r["step"] for r in metrics(run)) == stop
    # Both ranks got the signal themselves and stopped after the same step.
    for rank in (0, 1):
        assert f"[llmft rank {rank}] stopped by SIGTERM after step {stop}; checkpoint written" in log, log[-4000:]
    return stop


def _torchrun_cmd(recipe: Path) -> list[str]:
    # A slow monitor: every rank finishes its own exit 75 before torchrun tears the group down.
    return [*torchrun_cmd(2), "--monitor-interval=3", "-m", "llmft", "train", str(recipe)]


def _stop_and_resume(tmp_path: Path, engine: dict, cmd) -> None:
    recipe = _recipe(tmp_path / "stopped", engine)
    run = tmp_path / "stopped/run"
    _, log = _killpg_after_step_2(cmd(recipe), run)
    stop = _assert_stopped_on_a_boundary(run, log)

    ref = _recipe(tmp_path / "ref", engine)
    done = torchrun(["train", str(ref)])
    assert done.returncode == 0, done.stderr[-4000:]
    done = torchrun(["train", str(recipe)])
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"step-{stop} (step {stop}," in done.stderr
    rows, ref_rows = metrics(run), metrics(tmp_path / "ref/run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, want in zip(rows, ref_rows, strict=True):
        assert row["tokens"] == want["tokens"] and abs(row["loss"] - want["loss"]) < 1e-5, row["step"]


def test_torchrun_process_group_sigterm_with_data_workers_checkpoints_on_a_boundary(tmp_path):
    recipe = _recipe(tmp_path, ENGINES["ddp"])
    # torchrun itself got the signal too: it waits for its workers and then reports the signal
    # (not their exit codes); every rank's own log line says it stopped and checkpointed.
    _, log = _killpg_after_step_2(_torchrun_cmd(recipe), tmp_path / "run")
    _assert_stopped_on_a_boundary(tmp_path / "run", log)


@pytest.mark.slow
# ``-m extended``: DDP (CI stops FSDP2 and ZeRO-2 this way, and resumes DDP in test_elastic.py).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n == "ddp" else n for n in ENGINES])
def test_torchrun_process_group_sigterm_then_resume_matches(tmp_path, name):
    _stop_and_resume(tmp_path, ENGINES[name], _torchrun_cmd)


DEEPSPEED = shutil.which("deepspeed", path=str(Path(sys.executable).parent))


@pytest.mark.slow
def test_deepspeed_launcher_process_group_sigterm_checkpoints_on_a_boundary(tmp_path):
    assert DEEPSPEED, "deepspeed installs its launcher beside python; without it the install is broken"
    recipe = _recipe(tmp_path, ENGINES["zero2"])
    cmd = [
        DEEPSPEED,
        "--num_gpus=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--no_local_rank",  # as launch/deepspeed.sh: the rank comes from the environment
        "--module",
        "llmft",
        "train",
        str(recipe),
    ]
    _, log = _killpg_after_step_2(cmd, tmp_path / "run")
    _assert_stopped_on_a_boundary(tmp_path / "run", log)
