"""The README's quickstart, shortened: the shipped recipe trains end to end and leaves what it promises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, metrics


def test_quickstart_shortened_end_to_end(tmp_path):
    run = tmp_path / "quickstart"
    cmd = [
        sys.executable,
        "-m",
        "llmft",
        "train",
        "configs/quickstart.yaml",
        f"run.output_dir={run}",
        "train.max_steps=24",
        "train.eval_every_steps=12",
        "train.eval_generate_samples=8",
        "optim.warmup_steps=4",
        "checkpoint.every_steps=12",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert "batch: micro 16 x accumulation 2 x data-parallel 1 = global 32" in err
    tail = err.strip().splitlines()[-4:]
    assert tail[0].endswith("done.") and "model:" in tail[1] and "metrics:" in tail[2] and "plot:" in tail[3]

    train = metrics(run)
    assert [r["step"] for r in train] == list(range(1, 25))
    assert all({"loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= r.keys() for r in train)
    assert sum(r["loss"] for r in train[-4:]) < sum(r["loss"] for r in train[:4])  # it learns
    evals = metrics(run, "eval")
    assert [r["step"] for r in evals] == [12, 24]
    assert all(0.0 <= r["exact_match"] <= 1.0 and r["perplexity"] > 1.0 for r in evals)
    assert (run / "metrics.png").stat().st_size > 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-24"
    assert (run / "recipe.yaml").exists()


@pytest.mark.slow
def test_quickstart_tools_shortened_end_to_end(tmp_path):
    """configs/quickstart-tools-sft.yaml then configs/quickstart-tools.yaml as their headers run them,
    shortened: the SFT's export is the GRPO's policy, episodes call the calculator, the eval scores them."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(["examples/tools", "examples/rewards", os.environ.get("PYTHONPATH", "")]),
    }

    def llmft(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "llmft", *args], capture_output=True, text=True, cwd=ROOT, timeout=600, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]

    sft, model, grpo = tmp_path / "sft", tmp_path / "sft-model", tmp_path / "grpo"
    llmft("train", "configs/quickstart-tools-sft.yaml", f"run.output_dir={sft}", "train.max_steps=40")
    llmft("export", str(sft), "--out", str(model))
    llmft(
        "train",
        "configs/quickstart-tools.yaml",
        f"run.output_dir={grpo}",
        f"model.name_or_path={model}",
        "train.max_steps=2",
        "train.eval_every_steps=2",
        "train.eval_max_batches=1",
    )
    rows = metrics(grpo)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(
        {"turns", "tool_calls", "tool_failures", "tool_parse_failures", "rewards/correct"} <= r.keys() for r in rows
    )
    assert [r["step"] for r in metrics(grpo, "eval")] == [2]
