"""The world the launcher started is the truth (docs/batch.md, docs/multinode.md).

`llmft train` reads the launched world from the environment (torchrun, the deepspeed launcher,
srun, a bare WORLD_SIZE/RANK) and resolves the plan for it: three batch numbers that hold for
the launched world are used as given, three that hold only for the recipe's layout (a compiled
plan) are re-solved, neither is an error naming both. Where `distributed.nproc_per_node` or
`distributed.nnodes` in the recipe disagree with the launch, a note names both. Each launcher's
environment is faked here; tests/distributed/test_launched_world_ranks.py launches torchrun for real.
"""

from __future__ import annotations

import os

import pytest
from helpers import write_recipe

from llmft.job.dist import DistEnv, read_env
from llmft.plan.resolve import load_plan
from llmft.recipe.load import RecipeError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def torchrun(world: int, local: int, rank: int = 0) -> dict[str, str]:
    return {
        **TORCHRUN,
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_WORLD_SIZE": str(world // local),
    }


def deepspeed(world: int, local: int, rank: int = 0) -> dict[str, str]:
    """What deepspeed/launcher/launch.py sets for each rank: LOCAL_SIZE, not LOCAL_WORLD_SIZE."""
    return {
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_SIZE": str(local),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }


def srun(world: int, tasks_per_node: str, rank: int = 0) -> dict[str, str]:
    return {
        "SLURM_NTASKS": str(world),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "MASTER_ADDR": "127.0.0.1",
    }


def bare(world: int, rank: int = 0) -> dict[str, str]:
    """WORLD_SIZE/RANK from a launcher that says nothing about nodes (an mpirun wrapper, a script)."""
    return {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": "0"}


@pytest.fixture
def launched(monkeypatch):
    """``launched(env_vars)`` -> the DistEnv ``read_env`` makes of exactly those variables."""

    def make(variables: dict[str, str]) -> DistEnv:
        monkeypatch.setattr(os, "environ", dict(variables))
        return read_env()

    return make


@pytest.fixture
def recipe(tmp_path):
    """Micro, accumulation and global all set for two ranks (2 x 4 x 2 = 16), launched on two."""
    return write_recipe(
        tmp_path,
        batch__global_batch_size=16,
        batch__micro_batch_size=2,
        batch__gradient_accumulation_steps=4,
        distributed__engine="ddp",
    )


def plan_for(env: DistEnv, recipe, *overrides: str):
    """The plan ``llmft train`` resolves for ``env`` (llmft/training/train.py)."""
    return load_plan(
        recipe,
        list(overrides),
        world_size=env.world_size,
        local_world_size=env.launched_per_node,
        launcher=env.launcher,
    )


# --- what each launcher's environment says -------------------------------------------------------


@pytest.mark.parametrize(
    "variables, expected",
    [
        (torchrun(4, 2, rank=3), (3, 4, 1, 2, "torchrun", 2)),
        (deepspeed(4, 2, rank=1), (1, 4, 1, 2, "deepspeed", 2)),
        (srun(4, "2(x2)", rank=2), (2, 4, 0, 2, "srun", 2)),
        (srun(7, "4,3", rank=2), (2, 7, 0, 4, "srun", 4)),
        (bare(4, rank=1), (1, 4, 0, 4, "env", None)),  # processes per node unknown
        ({}, (0, 1, 0, 1, "none", 1)),
    ],
    ids=["torchrun", "deepspeed", "srun", "srun-uneven", "bare", "plain"],
)
def test_each_launcher_environment_is_read(launched, variables, expected):
    """(rank, world_size, local_rank, local_world_size, launcher, processes per node as launched)."""
    env = launched(variables)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == expected[:5]
    assert env.launched_per_node == expected[5]


# --- three numbers set for the launched world ------------------------------------------


def test_torchrun_2_with_three_numbers_for_two_ranks(recipe):
    """`torchrun --nproc_per_node 2 -m llmft train` with 2 x 4 x 2 = 16 was refused: "micro 2 x
    accumulation 4 x data-parallel 1 = 8, but global_batch_size is 16" (the recipe's 1 x 1 layout)."""
    plan = load_plan(recipe, [], world_size=2, local_world_size=2)
    assert plan.batch.equation() == "micro 2 x accumulation 4 x data-parallel 2 = global 16"


@pytest.mark.parametrize(
    "variables",
    [torchrun(2, 2), deepspeed(2, 2), srun(2, "2"), bare(2)],
    ids=["torchrun", "deepspeed", "srun", "bare"],
)
def test_three_numbers_for_the_launched_world_are_used_as_given(launched, recipe, variables):
    plan = plan_for(launched(variables), recipe)
    assert plan.batch.equation() == "micro 2 x accumulation 4 x data-parallel 2 = global 16"
    assert (plan.world.nnodes, plan.world.nproc_per_node) == (1, 2)
    assert plan.notes == ()  # the recipe says nothing about the layout: nothing disagrees


def test_auto_accumulation_uses_the_launched_world(launched, recipe):
    plan = plan_for(launched(torchrun(4, 2)), recipe, "batch.gradient_accumulation_steps=auto")
    assert plan.batch.equation() == "micro 2 x accumulation 2 x data-parallel 4 = global 16"
    assert (plan.world.nnodes, plan.world.nproc_per_node) == (2, 2)


@pytest.mark.parametrize(
    "variables, who",
    [(torchrun(2, 2), "torchrun"), (deepspeed(2, 2), "the deepspeed launcher"), (srun(2, "2"), "srun")],
    ids=["torchrun", "deepspeed", "srun"],
)
def test_a_recipe_layout_that_disagrees_is_named_and_the_launch_used(launched, recipe, variables, who):
    plan = plan_for(launched(variables), recipe, "distributed.nproc_per_node=4")
    assert plan.batch.equation() == "micro 2 x accumulation 4 x data-parallel 2 = global 16"
    assert plan.notes == (
        f"distributed.nproc_per_node is 4 in the recipe, but {who} started 2 processes per node: using 2",
    )
    assert plan.resolved_recipe().distributed.nproc_per_node == 2  # what the run's recipe.yaml records


def test_nodes_that_disagree_are_named(launched, recipe):
    plan = plan_for(launched(deepspeed(4, 2)), recipe, "distributed.nnodes=1", "batch.gradient_accumulation_steps=auto")
    assert (plan.world.nnodes, plan.world.nproc_per_node) == (2, 2)
    assert plan.notes == (
        "distributed.nnodes is 1 in the recipe, but the deepspeed launcher started 2 node(s): using 2",
    )


def test_a_batch_that_holds_for_neither_layout_is_refused_naming_both(launched, recipe):
    with pytest.raises(RecipeError) as e:
        plan_for(launched(torchrun(2, 2)), recipe, "distributed.nproc_per_node=4", "batch.global_batch_size=24")
    assert (
        "batch: inconsistent: micro 2 x accumulation 4 x data-parallel 2 = 16, but global_batch_size is 24 "
        "(distributed.nproc_per_node is 4 in the recipe, but torchrun started 2 processes per node: using 2). "
        "Set one of: global_batch_size=16" in str(e.value)
    )


def test_a_plan_compiled_for_another_layout_is_re_solved_for_the_launch(launched, recipe):
    """Three numbers that hold for the recipe's 4 processes only (what `llmft compile
    --nproc-per-node 4` writes): the global batch is kept, accumulation re-solved for the launch."""
    plan = plan_for(launched(torchrun(2, 2)), recipe, "distributed.nproc_per_node=4", "batch.global_batch_size=32")
    assert plan.batch.equation() == "micro 2 x accumulation 8 x data-parallel 2 = global 32"
    assert plan.notes == (
        "distributed.nproc_per_node is 4 in the recipe, but torchrun started 2 processes per node: using 2",
        "world size 2 differs from the compiled 4: re-solved to micro 2 x accumulation 8 x data-parallel 2 = global 32",
    )


def test_a_plain_process_is_one_rank_whatever_the_recipe_says(launched, recipe):
    plan = plan_for(launched({}), recipe, "distributed.nproc_per_node=2", "distributed.engine=single")
    assert plan.batch.equation() == "micro 2 x accumulation 8 x data-parallel 1 = global 16"
    assert plan.notes[0] == (
        "distributed.nproc_per_node is 2 in the recipe, but llmft train runs as one process (no launcher): using 1"
    )


def test_a_launcher_silent_about_nodes_keeps_the_recipes_split_of_the_same_size(launched, recipe):
    env = launched(bare(4))
    kept = plan_for(env, recipe, "distributed.nnodes=2", "distributed.nproc_per_node=2", "batch.global_batch_size=32")
    assert (kept.world.nnodes, kept.world.nproc_per_node) == (2, 2) and kept.notes == ()
    one_node = plan_for(env, recipe, "batch.global_batch_size=32")
    assert (one_node.world.nnodes, one_node.world.nproc_per_node) == (1, 4)
