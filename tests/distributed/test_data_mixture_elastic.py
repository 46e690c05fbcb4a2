"""A probability mixture stopped on 2 ranks and resumed on 1 takes the same samples per step and the
same losses as the uninterrupted 2-rank run (G4 with data.mixture: probability)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import INSTRUMENTED, ROOT, metrics, sample_log, torchrun, write_data, write_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP = 10, 4


def _recipe(root: Path, steps: int, every: int | None) -> Path:
    if not (root / "a.jsonl").exists():  # written once: the resume finds the same cache entries
        write_data(root / "a.jsonl", n=30, seed=1)
        write_data(root / "b.jsonl", n=12, seed=2, kind="text")
    return write_recipe(
        root,
        data__train=[{"path": str(root / "a.jsonl"), "weight": 0.7}, {"path": str(root / "b.jsonl"), "weight": 0.3}],
        data__mixture="probability",
        data__cache_dir=str(root.parent / "cache"),
        distributed__engine="fsdp",  # DCP checkpoints, resharded from 2 ranks to 1
        batch__global_batch_size=8,
        batch__micro_batch_size=2,
        train__max_steps=steps,
        checkpoint__every_steps=every,
    )


def test_probability_mixture_two_ranks_stopped_resume_on_one(tmp_path):
    ref = tmp_path / "ref"
    done = torchrun(["train", str(_recipe(ref, STEPS, None))], env={"LLMFT_SAMPLE_LOG": str(ref / "samples")})
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "run"
    done = torchrun(["train", str(_recipe(run, STOP, STOP))], env={"LLMFT_SAMPLE_LOG": str(run / "before")})
    assert done.returncode == 0, done.stderr[-4000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMFT_SAMPLE_LOG": str(run / "after")}
    cmd = [sys.executable, INSTRUMENTED, "train", str(_recipe(run, STEPS, None))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "elastic resume: checkpoint written by 2 process(es), now 1" in done.stderr
    before, after, want = sample_log(run / "before"), sample_log(run / "after"), sample_log(ref / "samples")
    assert sorted(before) == list(range(1, STOP + 1)) and sorted(after) == list(range(STOP + 1, STEPS + 1))
    assert {**before, **after} == want
    rows, ref_rows = metrics(run / "run"), metrics(ref / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, r in zip(rows, ref_rows, strict=True):
        assert row["tokens"] == r["tokens"] and abs(row["loss"] - r["loss"]) < 1e-5, row["step"]
