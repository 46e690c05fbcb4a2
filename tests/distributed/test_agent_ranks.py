"""Live multi-turn episodes on 2 ranks (``rollout.tools``): every rank draws each turn together (FSDP2
shards the parameters: ranks whose episodes ended keep joining their peers' forwards), in as many
``generate()`` calls of ``rollout.batch_size`` rows as the busiest rank needs (a rank with fewer
episodes going draws discarded rows), and the episodes the run saved, replayed from a file on the
same 2 ranks, land on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from agent_runs import tool_recipe
from grpo_runs import G, replay_file
from helpers import ROOT, TWO_RANK_ENGINES, max_rel_diff, metrics, torchrun

from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = pytest.mark.distributed


def _weights(tmp: Path):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", pytest.param("ddp", marks=pytest.mark.extended)])
def test_two_ranks_generate_episodes_in_step_and_train_them_exactly(tmp_path, agent_tools, tool_model_dir, engine):
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    over = [*TWO_RANK_ENGINES[engine], "batch.micro_batch_size=2", "train.max_steps=2"]
    live = tmp_path / "live"
    recipe = tool_recipe(live, tool_model_dir, rollout__save_completions=True, rollout__batch_size=3)
    proc = torchrun(["train", str(recipe), *over], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(live / "run")
    assert rows[0]["tool_calls"] > 0
    replay = replay_file(live / "run", tmp_path / "episodes.jsonl", G)
    given = tmp_path / "file"
    recipe = tool_recipe(given, tool_model_dir, rollout__backend="file", rollout__file=str(replay), rollout__tools=[])
    proc = torchrun(["train", str(recipe), *over], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert max_rel_diff(_weights(given), _weights(live)) <= 1e-5
