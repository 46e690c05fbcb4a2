"""A NaN/inf loss stops the run with a clear message and leaves the last good checkpoint as latest."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT, metrics, write_recipe


def test_non_finite_loss_stops_without_touching_the_last_checkpoint(tmp_path):
    recipe = write_recipe(tmp_path, train__max_steps=8, checkpoint__every_steps=1)
    # SGD with an absurd lr and no clipping overflows within a few steps.
    cmd = [
        sys.executable,
        "-m",
        "llmft",
        "train",
        str(recipe),
        "optim.name=sgd",
        "optim.lr=1e18",
        "optim.max_grad_norm=null",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "(not finite); no optimizer step was taken and the last checkpoint is untouched" in done.stderr
    assert "Traceback" not in done.stderr
    logged = [r["step"] for r in metrics(tmp_path / "run")]
    latest = (tmp_path / "run/checkpoints/latest").read_text().strip()
    assert latest == f"step-{logged[-1]}"  # every finite step was checkpointed, the bad one was not
    assert not (tmp_path / f"run/checkpoints/step-{logged[-1] + 1}").exists()
