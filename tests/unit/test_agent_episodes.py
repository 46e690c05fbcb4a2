"""GRPO on live multi-turn episodes (``rollout.tools``) with a tiny model fitted to call a tool: the
episodes' policy tokens are trained and counted, the tool results and the turn headers are context;
any split is the big batch; a resume inside a generation batch lands on the uninterrupted run's
weights (a run killed -9 inside a tool call: tests/integration/test_agent_kill.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from agent_runs import tool_recipe
from grpo_runs import G, replay_file
from helpers import max_rel_diff, metrics, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state


def _weights(tmp: Path):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


def test_any_split_is_the_big_batch_and_counts_only_policy_tokens(tmp_path, agent_tools, tool_model_dir):
    over = ["rl.iterations=2", "rl.beta=0.05", "rollout.save_completions=true"]
    assert train_inproc(tool_recipe(tmp_path / "big", tool_model_dir), *over) == 0
    split = tool_recipe(tmp_path / "split", tool_model_dir, batch__micro_batch_size=2)
    assert train_inproc(split, *over) == 0
    assert max_rel_diff(_weights(tmp_path / "split"), _weights(tmp_path / "big")) <= 1e-5
    saved = (tmp_path / "big" / "run" / "completions" / "rank-0.jsonl").read_text().splitlines()
    first = [line for line in map(json.loads, saved) if line["generation"] == 0]
    assert len(first) == 8
    policy = sum(sum(line["policy_mask"]) for line in first)
    tokens = sum(len(line["completion_ids"]) for line in first)
    called = [line for line in first if any(m["role"] == "tool" for m in line["messages"])]
    assert called and policy < tokens  # tool results and headers are in the sequences, not counted
    for line in called:
        assert [m["content"] for m in line["messages"] if m["role"] == "tool"] == ["3"]  # add(1, 2) ran
    rows = metrics(tmp_path / "big" / "run")
    assert rows[0]["completion_tokens"] == policy and rows[0]["tokens"] == policy
    assert rows[0]["tool_calls"] == pytest.approx(len(called) / 8)  # one call each
    assert rows[0]["turns"] == pytest.approx((8 + len(called)) / 8)


def test_a_resume_inside_a_generation_batch_is_exact(tmp_path, agent_tools, tool_model_dir):
    over = ["rl.iterations=2"]
    assert train_inproc(tool_recipe(tmp_path / "whole", tool_model_dir), *over, "train.max_steps=4") == 0
    cut = tool_recipe(tmp_path / "resumed", tool_model_dir)
    assert train_inproc(cut, *over, "train.max_steps=3", "checkpoint.every_steps=1") == 0
    state = torch.load(tmp_path / "resumed/run/checkpoints/step-3/objective/rank-0.pt", weights_only=True)
    assert len(state["prompt_ids"]) == 8  # the prompts as rendered for the episodes
    assert train_inproc(cut, *over, "train.max_steps=4") == 0  # resumes inside generation batch 1
    assert max_rel_diff(_weights(tmp_path / "resumed"), _weights(tmp_path / "whole")) <= 1e-6


def test_a_live_run_and_the_file_run_of_its_saved_episodes_land_on_the_same_weights(
    tmp_path, agent_tools, tool_model_dir
):
    """The episodes a live run saved, given to a file run (``completion_ids`` with ``policy_masks``,
    ``prompt_ids`` and ``episodes``): the same tokens trained, the same rewards, the same weights."""
    live = tmp_path / "live"
    over = ["train.max_steps=3", "rl.beta=0.05"]
    assert train_inproc(tool_recipe(live, tool_model_dir, rollout__save_completions=True), *over) == 0
    replay = replay_file(live / "run", tmp_path / "episodes.jsonl", G)
    given = tool_recipe(
        tmp_path / "file", tool_model_dir, rollout__backend="file", rollout__file=str(replay), rollout__tools=[]
    )
    assert train_inproc(given, *over) == 0
    assert max_rel_diff(_weights(tmp_path / "file"), _weights(live)) <= 1e-5
    assert [r["reward"] for r in metrics(tmp_path / "file" / "run")] == [r["reward"] for r in metrics(live / "run")]
    assert [r["tokens"] for r in metrics(tmp_path / "file" / "run")] == [r["tokens"] for r in metrics(live / "run")]


def test_llmft_verify_checks_a_split_of_live_episodes(tmp_path, agent_tools, tool_model_dir, capsys):
    """``llmft verify`` on a recipe generating episodes with a tool: 2 emulated ranks x micro 2 against
    the big batch, on the same episodes."""
    from llmft.training.verify import verify

    recipe = tool_recipe(tmp_path, tool_model_dir, batch__micro_batch_size=2)
    assert verify(str(recipe), ["distributed.nproc_per_node=2"]) == 0
    assert "PASS: largest relative difference" in capsys.readouterr().out
