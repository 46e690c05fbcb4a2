"""Parallel dimensions added from outside llmft (tests/tensor_dimension.py: a split dimension like
tensor parallelism; tests/expert_dimension.py: one borrowed from ``shard`` as expert parallelism is;
one record and one module each) reach the batch plan, the batch equation that ``llmft compile`` and
``llmft plan`` print, ``plan.yaml``, the memory planner and the layout's meshes, with no edit inside
llmft; combinations that cannot be laid out are refused naming their keys. The world mesh built
from such a layout: tests/distributed/test_world_mesh.py. docs/design.md, "The parallel layout"."""

from __future__ import annotations

import pytest
import yaml
from helpers import write_recipe

from llmft.plan.batch import BatchPlan
from llmft.plan.compile import compile_recipe
from llmft.plan.dims import DIMENSIONS, register_dimension
from llmft.plan.fsdp import fsdp_plan
from llmft.plan.memory import estimate_memory
from llmft.plan.report import plan_command
from llmft.plan.resolve import load_plan
from llmft.recipe.load import RecipeError

FSDP = ["distributed.engine=fsdp"]


@pytest.fixture
def registered(monkeypatch):
    """Both records registered (as importing their modules does), and removed afterwards."""
    saved = list(DIMENSIONS)
    import expert_dimension
    import tensor_dimension

    register_dimension(tensor_dimension.RECORD)
    register_dimension(expert_dimension.RECORD)
    monkeypatch.delenv(tensor_dimension.ENV, raising=False)
    monkeypatch.delenv(expert_dimension.ENV, raising=False)
    yield monkeypatch
    DIMENSIONS[:] = saved


@pytest.fixture
def recipe(tmp_path):
    return write_recipe(
        tmp_path, batch__global_batch_size=8, batch__micro_batch_size=2, model__attn_implementation="sdpa"
    )


def test_a_split_dimension_reaches_the_batch_plan_the_equation_the_files_and_the_mesh(registered, recipe, tmp_path):
    unsplit = load_plan(recipe, FSDP, nproc_per_node=4)
    assert "tensor_parallel" not in unsplit.batch.to_dict()  # sized 1: nothing changes
    assert unsplit.batch.equation() == "micro 2 x accumulation 1 x data-parallel 4 = global 8"

    registered.setenv("LLMFT_TEST_TENSOR_PARALLEL", "2")
    keys = [*FSDP, "distributed.sequence_parallel=2"]
    plan = load_plan(recipe, keys, nproc_per_node=8)
    b, layout = plan.batch, plan.layout
    equation = (
        "micro 2 x accumulation 2 x data-parallel 2 (world 8 / sequence-parallel 2 / tensor-parallel 2) = global 8"
    )
    assert (b.dp_size, b.splits, b.equation()) == (2, (("sequence_parallel", 2), ("tensor_parallel", 2)), equation)
    assert f"batch: {equation}" in compile_recipe(plan, tmp_path / "compiled").splitlines()
    written = yaml.safe_load((tmp_path / "compiled" / "plan.yaml").read_text())["batch"]
    assert written["tensor_parallel"] == 2 and BatchPlan.from_dict(written) == b
    assert f"{equation}, 64 tokens per sequence" in plan_command(str(recipe), keys, nproc_per_node=8).splitlines()
    assert estimate_memory(plan).dp_size == 2

    # Ranks are row-major over the mesh: tp innermost, then sp; a data-parallel rank is 4 ranks.
    assert layout.mesh == (("replicate", 1), ("shard", 2), ("sp", 2), ("tp", 2))  # a borrowed 1 is no dimension
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.sp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.coordinate(r, "tp") for r in range(8)] == [0, 1] * 4
    # FSDP2 shards over the data and sequence ranks; the tensor ranks own their parameters.
    assert layout.param_view == (("replicate", 1), ("shard", 4), ("tp", 2)) and layout.param_mesh == (("shard", 4),)
    assert fsdp_plan(plan).mesh.shard == 4


def test_a_borrowed_dimension_changes_neither_the_world_nor_the_batch(registered, recipe):
    before = load_plan(recipe, FSDP, nproc_per_node=4)
    registered.setenv("LLMFT_TEST_BORROWED_PARALLEL", "2")
    plan = load_plan(recipe, FSDP, nproc_per_node=4)
    assert plan.batch == before.batch and plan.batch.equation() == before.batch.equation()
    layout = plan.layout
    assert layout.mesh == (("replicate", 1), ("shard", 2), ("xp", 2), ("sp", 1), ("tp", 1))
    assert [layout.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]  # its ranks see different sequences
    assert [layout.coordinate(r, "xp") for r in range(4)] == [0, 1, 0, 1]
    assert layout.param_mesh == (("shard", 4),) and layout.dp_shard == 4


@pytest.mark.parametrize(
    "env,keys,world,message",
    [
        (
            {"LLMFT_TEST_TENSOR_PARALLEL": "2"},
            ["distributed.sequence_parallel=2"],
            2,
            "distributed.tensor_parallel: 2 x distributed.sequence_parallel 2 = 4 ranks per data-parallel rank do not "
            "divide the world size 2. Choose one of 1 with distributed.sequence_parallel 2, or make those smaller.",
        ),
        (
            {"LLMFT_TEST_TENSOR_PARALLEL": "3"},
            [],
            4,
            "distributed.tensor_parallel: 3 does not divide the world size 4. Choose one of 1, 2 or 4.",
        ),
        (
            {"LLMFT_TEST_BORROWED_PARALLEL": "3"},
            [],
            4,
            "distributed.borrowed_parallel: 3 does not divide the 4 ranks of the shard dimension it is carved from. "
            "Choose one of 1, 2 or 4.",
        ),
    ],
)
def test_a_combination_that_cannot_be_laid_out_is_refused_naming_its_keys(
    registered, recipe, env, keys, world, message
):
    for name, value in env.items():
        registered.setenv(name, value)
    with pytest.raises(RecipeError) as e:
        load_plan(recipe, [*FSDP, *keys], nproc_per_node=world)
    assert message in str(e.value) and len(e.value.problems) == 1
