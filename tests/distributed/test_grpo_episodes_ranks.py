"""Multi-turn file episodes on 2 DDP ranks (``llmft.objectives.episodes``): groups of episodes across
ranks, every rank's context tokens out of the global count, the weights of one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from episode_runs import episode_recipe
from helpers import ROOT, max_rel_diff, metrics, torchrun, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = pytest.mark.distributed


def _weights(tmp: Path):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


@pytest.mark.slow
def test_two_ranks_train_episodes_as_one_process(tmp_path, episode_rewards):
    """Groups of episodes across 2 DDP ranks (micro 2): every rank's context tokens stay out of the
    global count, and the weights are one process's."""
    one = tmp_path / "one"
    assert train_inproc(episode_recipe(one), "peft.method=lora", "peft.r=4") == 0
    two = tmp_path / "two"
    recipe = episode_recipe(two)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    over = ["peft.method=lora", "peft.r=4", "distributed.engine=ddp", "batch.micro_batch_size=2"]
    proc = torchrun(["train", str(recipe), *over], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert max_rel_diff(_weights(two), _weights(one)) <= 1e-5
    assert [r["tokens"] for r in metrics(two / "run")] == [r["tokens"] for r in metrics(one / "run")]
