"""``distributed.expert_parallel`` in the plan (llmft/plan/dims.py ``EXPERT``, llmft/plan/moe_recipe.py;
docs/moe.md): a dimension borrowed from ``shard`` that leaves the world, the data-parallel size and
the global batch as they are, printed beside the batch equation, in the world mesh as ``ep``; and the
recipes it cannot serve, refused naming the key and the fix. The runtime: tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import pytest
from helpers import write_recipe
from test_moe import FAMILIES

from llmft.plan.compile import compile_recipe
from llmft.plan.report import plan_command
from llmft.plan.resolve import load_plan
from llmft.recipe.load import RecipeError

FSDP = ["distributed.engine=fsdp"]


@pytest.fixture
def recipe(tmp_path):
    return write_recipe(
        tmp_path, model__config=FAMILIES["qwen3_moe"], batch__global_batch_size=8, batch__micro_batch_size=2
    )


def test_expert_parallel_borrows_from_the_shard_dimension_and_leaves_the_batch(recipe, tmp_path):
    before = load_plan(recipe, FSDP, nproc_per_node=4)
    plan = load_plan(recipe, [*FSDP, "distributed.expert_parallel=2"], nproc_per_node=4)
    assert plan.batch == before.batch
    layout = plan.layout
    assert layout.mesh == (("replicate", 1), ("shard", 2), ("ep", 2), ("sp", 1))
    assert before.layout.mesh == (("replicate", 1), ("shard", 4), ("sp", 1))
    assert [layout.coordinate(r, "ep") for r in range(4)] == [0, 1, 0, 1]  # consecutive ranks: one expert group
    assert [layout.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]  # each still sees its own sequences
    assert layout.param_mesh == (("shard", 4),)  # FSDP2 still shards everything else over all 4
    equation = "micro 2 x accumulation 1 x data-parallel 4 = global 8 (expert-parallel 2 within data-parallel 4)"
    assert plan.equation() == equation
    assert f"batch: {equation}" in compile_recipe(plan, tmp_path / "compiled").splitlines()
    shown = plan_command(str(recipe), [*FSDP, "distributed.expert_parallel=2"], nproc_per_node=4)
    assert f"{equation}, 64 tokens per sequence" in shown.splitlines()
    assert before.equation() == before.batch.equation()


@pytest.mark.parametrize(
    "keys,world,message",
    [
        (
            ["distributed.engine=deepspeed", "distributed.expert_parallel=2"],
            2,
            "distributed.expert_parallel: is 2, but expert parallelism is built on FSDP2 only (distributed.engine "
            "is deepspeed; DeepSpeed's MoE layers are its own modules, not transformers' fused experts). Set "
            "distributed.engine=fsdp, or distributed.expert_parallel=1",
        ),
        (
            [*FSDP, "distributed.expert_parallel=3"],
            6,
            "distributed.expert_parallel: is 3, which does not divide the 8 routed experts of each MoE layer "
            "(num_experts): every rank holds the same number of whole experts. Choose a divisor of 8 that also "
            "divides the shard dimension: one of 1, 2, 4, 8.",
        ),
        (
            [*FSDP, "distributed.expert_parallel=4"],
            2,
            "distributed.expert_parallel: 4 does not divide the 2 ranks of the shard dimension it is carved from. "
            "Choose one of 1 or 2.",
        ),
        (
            [*FSDP, "distributed.expert_parallel=2", "peft.method=lora"],
            2,
            "distributed.expert_parallel: is 2 with LoRA on the experts (peft.target_experts): LoRA on experts "
            "placed on other ranks is not built. Set peft.target_experts=false",
        ),
        (
            [*FSDP, "distributed.expert_parallel=2", "distributed.sequence_parallel=2"],
            4,
            "distributed.expert_parallel: is 2 with distributed.sequence_parallel 2: expert parallelism over "
            "sequence slices is not built. Use one of them",
        ),
        (
            [*FSDP, "distributed.expert_parallel=0"],
            2,
            "distributed.expert_parallel: 0 must be >= 1",
        ),
    ],
)
def test_what_expert_parallelism_cannot_serve_is_refused_naming_the_key(recipe, keys, world, message):
    with pytest.raises(RecipeError) as e:
        load_plan(recipe, keys, nproc_per_node=world)
    assert message in str(e.value)


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path):
    dense = write_recipe(tmp_path)
    with pytest.raises(RecipeError) as e:
        load_plan(dense, [*FSDP, "distributed.expert_parallel=2"], nproc_per_node=2)
    assert "distributed.expert_parallel: is 2, but the model ('llama') is dense: it has no experts to place on " in str(
        e.value
    )


def test_the_planner_holds_e_over_n_experts_per_rank_and_the_exchange_buffers(recipe):
    from llmft.plan.memory import all_to_all_bytes, count_params, estimate_memory
    from llmft.plan.shape import model_shape

    def plan(n: int):
        return load_plan(recipe, [*FSDP, f"distributed.expert_parallel={n}"], nproc_per_node=4)

    one, two, four = (estimate_memory(plan(n)) for n in (1, 2, 4))
    p = plan(2)
    shape = model_shape(p.recipe.model)
    params = count_params(p.recipe, shape)
    experts = params.expert_weights * 4  # fp32: weights; full fine-tune: their gradients and AdamW state too
    assert two.weights - one.weights == pytest.approx(experts / 2 - experts / 4, abs=2)
    assert four.weights == pytest.approx(one.weights, abs=2)  # E / 4 whole experts = FSDP2's quarter
    assert two.gradients > one.gradients and two.optimizer > one.optimizer
    buffers = all_to_all_bytes(shape, p.layout, 2 * 64, 4)  # micro 2 x 64 tokens, K rows, four times
    assert buffers == 4 * 2 * 64 * 2 * shape.hidden_size * 4
    assert two.activations - one.activations == buffers
