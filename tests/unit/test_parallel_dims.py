"""One owner of every parallel dimension (``llmft.plan.dims`` records, sized once into
``ParallelLayout``): the layout's ranks, meshes and sizes for every layout the engines run; the batch
plan and the memory planner read the layout, not the recipe; a combination that cannot be laid out
is refused naming its keys. Pure: no process group."""

from __future__ import annotations

import pytest
from helpers import write_recipe

from llmft.plan.batch import BatchPlan
from llmft.plan.dims import DIMENSIONS, SHARD, Dimension, register_dimension
from llmft.plan.engines import engine_spec
from llmft.plan.fsdp import fsdp_plan
from llmft.plan.layout import layout_of
from llmft.plan.memory import estimate, estimate_memory, host_memory_per_node
from llmft.plan.resolve import load_plan
from llmft.recipe.load import RecipeError

ENGINES = {
    "ddp": ["distributed.engine=ddp", "peft.method=lora"],
    "fsdp": ["distributed.engine=fsdp"],
    "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2"],
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
}
# (engine, world, sequence_parallel, hsdp_replicate): every split the tiny model's 4 heads allow
LAYOUTS = [
    (engine, world, sp, replicate)
    for engine in ENGINES
    for world in (2, 4, 8)
    for sp in (1, 2, 4)
    for replicate in ((1, 2) if engine == "fsdp" else (1,))
    if world % sp == 0 and (world // sp) % replicate == 0
]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return write_recipe(
        tmp_path_factory.mktemp("dims"),
        batch__global_batch_size=16,
        batch__micro_batch_size=1,
        model__attn_implementation="sdpa",
    )


def _plan(recipe, engine: str, world: int, sp: int = 1, replicate: int = 1, *more: str):
    keys = [*ENGINES[engine], f"distributed.sequence_parallel={sp}", *more]
    keys += [f"distributed.hsdp_replicate={replicate}"] if replicate > 1 else []
    return load_plan(recipe, keys, nproc_per_node=world)


def test_every_layout_has_the_ranks_sizes_and_meshes_it_had(recipe):
    """For each engine, world, sequence_parallel and hsdp_replicate: the data-parallel and sequence
    ranks are ``rank // sp`` and ``rank % sp``, the mesh is replicate x shard x sp, FSDP2's
    parameter mesh is replicate x (every other rank), and the batch counts world / sp ranks."""
    for engine, world, sp, replicate in LAYOUTS:
        plan = _plan(recipe, engine, world, sp, replicate)
        layout, said = plan.layout, (engine, world, sp, replicate)
        assert (layout.world_size, layout.dp_size, layout.sp, layout.dp_replicate) == (
            world,
            world // sp,
            sp,
            replicate,
        )
        assert [layout.dp_rank(r) for r in range(world)] == [r // sp for r in range(world)], said
        assert [layout.sp_rank(r) for r in range(world)] == [r % sp for r in range(world)], said
        assert layout.mesh == (("replicate", replicate), ("shard", world // sp // replicate), ("sp", sp)), said
        sharded = engine in ("fsdp", "zero3")
        assert layout.shards_params == sharded and layout.dp_shard == (world // replicate if sharded else 1), said
        assert layout.param_view == (("replicate", replicate), ("shard", world // replicate)), said
        assert layout.param_mesh == ((("replicate", replicate),) if replicate > 1 else ()) + (
            ("shard", layout.dp_shard),
        )
        b = plan.batch
        assert (b.dp_size, b.sp, b.splits) == (world // sp, sp, (("sequence_parallel", sp),) if sp > 1 else ())
        if engine == "fsdp":
            assert (fsdp_plan(plan).mesh.replicate, fsdp_plan(plan).mesh.shard) == (replicate, world // replicate)


def test_the_batch_plan_is_written_as_before():
    """``sequence_parallel`` is in the batch's files only where it is over 1; the equation names it."""
    one, two = BatchPlan(8, 2, 2, 2), BatchPlan(8, 2, 2, 2, (("sequence_parallel", 2),))
    assert one.to_dict() == {
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "dp_size": 2,
    }
    assert two.to_dict() == {**one.to_dict(), "sequence_parallel": 2}
    assert one.equation() == "micro 2 x accumulation 2 x data-parallel 2 = global 8"
    assert two.equation() == "micro 2 x accumulation 2 x data-parallel 2 (world 4 / sequence-parallel 2) = global 8"
    assert BatchPlan.from_dict(two.to_dict()) == two and BatchPlan.from_dict(one.to_dict()) == one
    assert (one.sp, two.sp) == (1, 2)


def test_the_memory_planner_reads_the_layout_not_the_recipe(recipe):
    """With a resolved plan the planner takes the sequence-parallel size from its layout: the same
    estimate when the recipe object says otherwise afterwards. Without one (a number of
    data-parallel ranks), the recipe's dimensions through the same records."""
    plan = _plan(recipe, "zero3", 4, 2, 1, "data.max_seq_len=4096", "model.gradient_checkpointing=true")
    est, host = estimate_memory(plan), host_memory_per_node(plan)
    assert est.dp_size == 2
    object.__setattr__(plan.recipe.distributed, "sequence_parallel", 1)
    assert estimate_memory(plan) == est and host_memory_per_node(plan) == host
    object.__setattr__(plan.recipe.distributed, "sequence_parallel", 2)
    by_number = estimate(
        plan.recipe, plan.engine, 2, plan.batch.micro_batch_size, plan.batch.gradient_accumulation_steps
    )
    assert by_number == est
    unsplit = estimate(plan.recipe, plan.engine, layout_of(plan.recipe, engine_spec("single"), 2), 1, 8)
    assert 1.9 <= unsplit.activations / est.activations <= 2.1  # single has no sequence parallelism


def test_replica_groups_the_sequence_groups_leave_no_room_for_are_refused_naming_both_keys(recipe):
    """4 replica groups divide 4 ranks, but not the 2 data-parallel ranks that sequence
    parallelism 2 leaves (this reached FSDP2's plan and failed an assertion there)."""
    with pytest.raises(RecipeError) as e:
        _plan(recipe, "fsdp", 4, 2, 4)
    assert (
        "distributed.hsdp_replicate: 4 does not divide the data-parallel size 2 "
        "(world 4 / distributed.sequence_parallel 2). Choose a divisor of 2, or fewer ranks per data-parallel rank."
    ) in str(e.value)
    assert len(e.value.problems) == 1


def test_a_dimension_record_is_checked_when_registered():
    before = list(DIMENSIONS)
    with pytest.raises(ValueError, match="data parallelism is replicate x shard"):
        register_dimension(Dimension("pods", "data"))
    with pytest.raises(ValueError, match="'xp' borrows from 'sp', which is not a data dimension"):
        register_dimension(Dimension("xp", "borrow", key="distributed.borrowed_parallel", of="sp"))
    with pytest.raises(ValueError, match="'shard' is registered already"):
        register_dimension(Dimension("shard", "split"))
    with pytest.raises(ValueError, match="'cp' names no recipe key"):
        register_dimension(Dimension("cp", "split"))
    assert register_dimension(SHARD) is SHARD  # the same record again: nothing changes
    assert DIMENSIONS == before
