"""`torchrun --nproc_per_node 2 -m llmft train` with micro, accumulation and global all set for two
ranks (2 x 4 x 2 = 16) trains, and the start-up banner shows the launched world (one launch;
tests/unit/test_launched_world.py covers every launcher's environment without launching)."""

from __future__ import annotations

import json

import pytest
from helpers import metrics, torchrun, write_recipe

pytestmark = pytest.mark.distributed


def test_three_batch_numbers_set_for_two_ranks_train_under_torchrun(tmp_path):
    recipe = write_recipe(
        tmp_path,
        batch__global_batch_size=16,
        batch__micro_batch_size=2,
        batch__gradient_accumulation_steps=4,
        distributed__engine="ddp",
        train__max_steps=1,
    )
    done = torchrun(["train", str(recipe)], nproc=2, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-6000:]}"
    assert "batch: micro 2 x accumulation 4 x data-parallel 2 = global 16" in done.stderr  # the banner
    assert "processes per node" not in done.stderr  # the recipe names no layout: nothing disagrees
    run = tmp_path / "run"
    state = json.loads((run / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["batch"]["dp_size"] == 2
    assert [r["step"] for r in metrics(run)] == [1]
