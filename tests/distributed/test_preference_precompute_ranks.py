"""``preference.precompute_reference`` on 2 ranks, and elastic resume of dpo (docs/preference.md
"Precomputed reference", docs/checkpoints.md; docs/design.md G1, G4).

- 2 ranks with the precomputed reference == 2 ranks with the on-the-fly one (weights and every
  train/eval metric, fp32, 1e-6), on DDP, FSDP2 and ZeRO-3; the file the 2-rank pass writes holds
  the same bytes as the one a single process writes (LoRA on DDP and ZeRO-3, full on FSDP2 and ZeRO-3).
- Elastic resume: 2 ranks for 2 steps, resumed by one process for 2 more == 2 ranks for 4 steps
  (weights and loss curve, 1e-5), with and without the precomputed reference; the resumed run
  reads the stored log-probs back (the pass does not run again).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, metrics, torchrun
from preference_runs import assert_same_run, dpo_recipe, final_weights, reference_files

pytestmark = pytest.mark.distributed

ENGINES = {
    "ddp": ["distributed.engine=ddp"],
    "fsdp": ["distributed.engine=fsdp"],
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
}
CASES = [("ddp", "lora"), ("fsdp", "none"), ("zero3", "lora"), ("zero3", "none")]
EXTENDED = {("ddp", "lora"), ("zero3", "none")}


def _train_2(recipe: Path, *overrides: str) -> str:
    done = torchrun(["train", str(recipe), *overrides], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def _train_1(recipe: Path, *overrides: str) -> str:
    """``llmft train`` as one plain process (no launcher)."""
    cmd = [sys.executable, "-m", "llmft", "train", str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


@pytest.mark.slow
# CI runs one LoRA (ZeRO-3) and one full fine-tune (FSDP2); ``-m extended`` the others too.
@pytest.mark.parametrize(
    "engine,method",
    [pytest.param(*c, marks=pytest.mark.extended) if c in EXTENDED else c for c in CASES],
    ids=["-".join(c) for c in CASES],
)
def test_two_ranks_precomputed_equals_on_the_fly(tmp_path, engine, method):
    over = ENGINES[engine] + ["train.max_steps=2"]
    fly = dpo_recipe(tmp_path / "fly", peft__method=method)
    pre = dpo_recipe(tmp_path / "pre", peft__method=method, preference__precompute_reference=True)
    err = _train_2(pre, *over)
    assert "reference log-probs: computed 36 pairs on 2 rank(s)" in err
    _train_2(fly, *over)
    assert_same_run(tmp_path / "pre", tmp_path / "fly")

    # one process writes the same file (another cache dir: the same entry and reference keys)
    one = dpo_recipe(tmp_path / "one", peft__method=method, preference__precompute_reference=True)
    _train_1(one, *ENGINES[engine], f"data.cache_dir={tmp_path / 'cache1'}", "train.max_steps=1")
    two, single = reference_files(tmp_path / "cache"), reference_files(tmp_path / "cache1")
    assert [p.relative_to(tmp_path / "cache") for p in two] == [p.relative_to(tmp_path / "cache1") for p in single]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(two, single, strict=True))


@pytest.mark.slow
# CI: a full fine-tune precomputed, LoRA on the fly; ``-m extended`` the other two.
@pytest.mark.parametrize(
    "engine,method,precompute",
    [
        ("fsdp", "none", True),
        ("ddp", "lora", False),
        pytest.param("fsdp", "none", False, marks=pytest.mark.extended),
        pytest.param("ddp", "lora", True, marks=pytest.mark.extended),
    ],
    ids=["fsdp-none-precomputed", "ddp-lora-on-the-fly", "fsdp-none-on-the-fly", "ddp-lora-precomputed"],
)
def test_elastic_resume_two_ranks_to_one(tmp_path, engine, method, precompute):
    over = dict(peft__method=method, preference__precompute_reference=precompute, checkpoint__every_steps=2)
    straight = dpo_recipe(tmp_path / "straight", **over)
    _train_2(straight, *ENGINES[engine])
    elastic = dpo_recipe(tmp_path / "elastic", **over)
    _train_2(elastic, *ENGINES[engine], "train.max_steps=2")
    stamps = {f: f.stat().st_mtime_ns for f in reference_files(tmp_path / "cache")}
    err = _train_1(elastic, *ENGINES[engine])  # one process: accumulation 4 -> 8
    assert "resuming from" in err and "reference log-probs: computed" not in err
    assert ("reference log-probs: reused" in err) == precompute
    assert {f: f.stat().st_mtime_ns for f in reference_files(tmp_path / "cache")} == stamps
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "elastic")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-5), k
    ra, rb = metrics(tmp_path / "straight" / "run"), metrics(tmp_path / "elastic" / "run")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5, x["step"]
