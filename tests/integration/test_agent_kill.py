"""A GRPO run on live multi-turn episodes killed -9 inside a tool call or while scoring, then
resumed: the step's episodes are regenerated as they were, and the weights are the uninterrupted run's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from agent_runs import tool_recipe
from helpers import ROOT, max_rel_diff, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state


def _weights(run):
    return trainable_state(load_checkpoint_model(run)[0])


@pytest.mark.slow
@pytest.mark.parametrize("inside", ["TOOL", "SCORING"])
def test_a_run_killed_inside_a_tool_call_resumes_to_the_same_weights(tmp_path, agent_tools, tool_model_dir, inside):
    assert train_inproc(tool_recipe(tmp_path / "whole", tool_model_dir), "train.max_steps=3") == 0
    cut = tool_recipe(tmp_path / "killed", tool_model_dir, checkpoint__every_steps=1, train__max_steps=3)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        # the first tool call (or reward call) of step 2
        f"LLMFT_TEST_KILL_{'SCORING_' if inside == 'SCORING' else ''}AFTER": str(
            tmp_path / "killed/run/checkpoints/step-1"
        ),
    }
    run = [sys.executable, "-m", "llmft", "train", str(cut)]
    killed = subprocess.run(run, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (tmp_path / "killed/run/checkpoints/step-1").is_dir()
    assert not (tmp_path / "killed/run/checkpoints/step-3").exists()
    env.pop("LLMFT_TEST_KILL_AFTER", None)
    env.pop("LLMFT_TEST_KILL_SCORING_AFTER", None)
    resumed = subprocess.run(run, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max_rel_diff(_weights(tmp_path / "killed/run"), _weights(tmp_path / "whole/run")) <= 1e-6
