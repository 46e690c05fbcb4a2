"""An objective added from outside llmft (tests/weighted_sft_objective.py: one record, one module,
found through ``train.objective_module``) trains like a built-in one: any split of the batch over
micro-batches, accumulation and 2 FSDP2 ranks under torchrun gives the big batch's weights. Each
record carries its own ``weight``, read through the token cache (``ObjectiveSpec.fields``).

docs/design.md "Adding an objective"; G1 (accumulation is the big batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, max_rel_diff, metrics, torchrun, train_inproc, write_data, write_recipe

from llmft.export.consolidate import load_checkpoint_model, trainable_state

TESTS = ROOT / "tests"
PLUGIN = ["train.objective=weighted_sft", "train.objective_module=weighted_sft_objective"]
SGD = ["optim.name=sgd", "optim.lr=0.5", "data.packing=false", "batch.global_batch_size=8"]


def _recipe(tmp: Path) -> Path:
    """The tiny recipe over records that each carry a weight (1, 2 or 3: 1 + line % 3)."""
    data = write_data(tmp / "train.jsonl")
    records = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps({**r, "weight": 1 + i % 3}) + "\n" for i, r in enumerate(records)))
    return write_recipe(tmp)


def _weights(tmp: Path) -> dict:
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


def _one_process(tmp: Path, micro: int) -> dict:
    assert train_inproc(_recipe(tmp), *PLUGIN, *SGD, f"batch.micro_batch_size={micro}") == 0
    return _weights(tmp)


def test_a_registered_objective_trains_and_any_split_is_the_big_batch(tmp_path):
    big = _one_process(tmp_path / "big", 8)
    split = _one_process(tmp_path / "split", 2)  # 2 x 4 accumulation steps
    assert max_rel_diff(split, big) <= 1e-5
    row = metrics(tmp_path / "split" / "run")[-1]
    assert 0.3 < row["weighted/targets_per_weight"] < 1.0  # targets / summed weights (each weight 1-3)
    assert (tmp_path / "split" / "run" / "recipe.yaml").read_text().count("weighted_sft") == 2


def test_llmft_verify_runs_a_registered_objective(tmp_path, capsys):
    """``llmft verify`` prepares the micro-batches as the loop does, then counts and compares."""
    from llmft.training.verify import verify

    assert verify(str(_recipe(tmp_path)), [*PLUGIN, *SGD, "batch.micro_batch_size=2"]) == 0
    assert "weighted_sft" in capsys.readouterr().out


@pytest.mark.slow
def test_two_fsdp_ranks_equal_one_process(tmp_path):
    big = _one_process(tmp_path / "big", 8)
    recipe = _recipe(tmp_path / "fsdp")
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    over = [*PLUGIN, *SGD, "distributed.engine=fsdp", "batch.micro_batch_size=2"]  # 2 ranks x 2 x 2 steps
    proc = torchrun(["train", str(recipe), *over], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_rel_diff(_weights(tmp_path / "fsdp"), big) <= 1e-5
    # A fresh process exports it: the checkpoint's recipe names the module, which registers the record.
    out = tmp_path / "exported"
    cmd = [sys.executable, "-m", "llmft", "export", str(tmp_path / "fsdp" / "run"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "each target token weighted by its record's weight" in (out / "README.md").read_text()
