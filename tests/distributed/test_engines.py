"""The same recipe on every engine: 2 processes on gloo under torchrun, against one process.

docs/design.md G1 (accumulation is the big batch, on every engine) and G2 (one gradient
reduction per optimizer step).
"""

from __future__ import annotations

import pytest
import torch
from helpers import max_rel_diff, metrics, torchrun, train_inproc, write_recipe

from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = pytest.mark.distributed

SGD_ONE_STEP = ["optim.name=sgd", "optim.lr=1.0", "optim.max_grad_norm=null", "train.max_steps=1"]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    model, *_ = load_checkpoint_model(run_dir)
    return trainable_state(model)


@pytest.fixture(scope="module")
def single_sgd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    recipe = write_recipe(tmp)
    assert train_inproc(recipe, *SGD_ONE_STEP, "batch.micro_batch_size=8", "distributed.engine=single") == 0
    return tmp, _weights(tmp / "run")


ENGINES = [
    ("ddp", ["distributed.engine=ddp", "batch.micro_batch_size=2"]),
    ("fsdp", ["distributed.engine=fsdp", "batch.micro_batch_size=2"]),
    (
        "fsdp_micro_step_sync",
        ["distributed.engine=fsdp", "batch.micro_batch_size=1", "distributed.fsdp_grad_sync=micro_step"],
    ),
    ("zero0", ["distributed.engine=deepspeed", "distributed.zero_stage=0", "batch.micro_batch_size=2"]),
    ("zero1", ["distributed.engine=deepspeed", "distributed.zero_stage=1", "batch.micro_batch_size=2"]),
    ("zero2", ["distributed.engine=deepspeed", "distributed.zero_stage=2", "batch.micro_batch_size=2"]),
    ("zero3", ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=1"]),
]


@pytest.mark.parametrize("name,overrides", ENGINES, ids=[e[0] for e in ENGINES])
def test_one_sgd_step_matches_single_process(tmp_path, single_sgd, name, overrides):
    _, ref = single_sgd
    recipe = write_recipe(tmp_path)
    done = torchrun(["train", str(recipe), *SGD_ONE_STEP, *overrides])
    assert done.returncode == 0, done.stderr[-4000:]
    weights = _weights(tmp_path / "run")
    assert max_rel_diff(weights, ref) < 1e-4
    rows = metrics(tmp_path / "run")
    ref_rows = metrics(single_sgd[0] / "run")
    assert rows[0]["tokens"] == ref_rows[0]["tokens"]
    assert abs(rows[0]["loss"] - ref_rows[0]["loss"]) < 1e-5


def _reductions_per_micro_step(tmp_path, engine: str, *overrides: str) -> list[tuple[bool, int]]:
    import json

    recipe = write_recipe(tmp_path)
    done = _probe("collectives_probe.py", [str(recipe), engine, str(tmp_path / "run"), *overrides])
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("COLLECTIVES "))
    log = json.loads(line.split(" ", 1)[1])["per_micro_step"]
    assert [boundary for boundary, _ in log] == [False, False, False, True] * 3
    return log


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_one_gradient_reduction_per_optimizer_step(tmp_path, engine):
    """At accumulation 4, only the last micro-step of each optimizer step reduces gradients."""
    log = _reductions_per_micro_step(tmp_path, engine)
    assert all(n == 0 for boundary, n in log if not boundary)  # no communication inside the cycle
    per_step = [n for boundary, n in log if boundary]
    assert per_step[0] > 0 and len(set(per_step)) == 1  # one reduction (set of buckets) per step


def test_fsdp_micro_step_sync_reduce_scatters_every_micro_step(tmp_path):
    """distributed.fsdp_grad_sync=micro_step: each micro-step's backward reduce-scatters (the same
    set as the boundary mode's one per step), so gradients stay sharded while accumulating."""
    boundary = _reductions_per_micro_step(tmp_path / "boundary", "fsdp")
    every = _reductions_per_micro_step(tmp_path / "every", "fsdp", "distributed.fsdp_grad_sync=micro_step")
    per_step = next(n for b, n in boundary if b)
    assert per_step > 0 and all(n == per_step for _, n in every)


def _probe(script: str, args: list[str], timeout: int = 400):
    import os
    import subprocess

    from helpers import ROOT, torchrun_cmd

    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


CHUNKED = [("fsdp", ENGINES[1][1]), ("zero3", ENGINES[5][1])]


@pytest.mark.parametrize("name,overrides", CHUNKED, ids=[e[0] for e in CHUNKED])
def test_chunked_loss_step_matches_single_process(tmp_path, single_sgd, name, overrides):
    """model.chunked_loss=true in chunks of 16 tokens (tests/distributed/chunked_probe.py) on a
    sharding engine: the same step as one plain process."""
    _, ref = single_sgd
    recipe = write_recipe(tmp_path)
    done = _probe("chunked_probe.py", [str(recipe), *SGD_ONE_STEP, *overrides, "model.chunked_loss=true"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert max_rel_diff(_weights(tmp_path / "run"), ref) < 1e-4
    assert abs(metrics(tmp_path / "run")[0]["loss"] - metrics(single_sgd[0] / "run")[0]["loss"]) < 1e-5
