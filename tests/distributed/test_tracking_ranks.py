"""run.trackers across a change of world size: a job on 2 torchrun ranks, stopped, resumed on 1
(tests/integration/test_tracking.py has the rest)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from helpers import INSTRUMENTED, ROOT, torchrun_cmd, wait_for_step, write_recipe
from trackers import job_cmd, job_env, losses, mlflow_run, mlflow_steps, wandb_segments, wandb_steps

# optional extras (`pip install llmft[wandb,mlflow]`): without them these tests say so and skip
pytest.importorskip("wandb", reason="the wandb extra is not installed")
pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_resume_on_another_world_size_continues_the_same_tracked_run(tmp_path):
    """Two ranks stopped by SIGTERM to the launcher's process group, resumed as one process: the same
    W&B and MLflow runs, each step once (only rank 0 ever logs)."""
    steps = 12
    recipe = write_recipe(
        tmp_path, run__trackers=["wandb", "mlflow"], train__max_steps=steps, distributed__engine="ddp"
    )
    run = tmp_path / "run"
    cmd = [*torchrun_cmd(2), "--monitor-interval=3", INSTRUMENTED, "train", str(recipe)]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env=job_env(tmp_path), cwd=ROOT, start_new_session=True
    )
    wait_for_step(run, 1, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    stopped_at = int((run / "checkpoints/latest").read_text().removeprefix("step-"))
    assert 1 <= stopped_at < steps, err[-3000:]

    done = subprocess.run(job_cmd(recipe), capture_output=True, text=True, env=job_env(tmp_path), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "elastic resume: checkpoint written by 2 process(es), now 1" in done.stderr
    assert "wandb: continuing run_id" in done.stderr and "mlflow: continuing run_id" in done.stderr
    train = losses(run)
    assert [s for s, _ in train] == list(range(1, steps + 1))
    segments = wandb_segments(run)
    assert len({seg["run_id"] for seg in segments if seg["run_id"]}) == 1
    assert wandb_steps(segments, "train/loss") == train
    client, mrun = mlflow_run(tmp_path)
    assert mlflow_steps(client, mrun.info.run_id, "train/loss") == train
