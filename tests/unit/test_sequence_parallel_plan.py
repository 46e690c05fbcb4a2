"""``distributed.sequence_parallel``: the plan (docs/long-context.md). Pure: no process group."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import write_recipe

from llmft.plan.batch import BatchPlan
from llmft.plan.compile import compile_recipe
from llmft.plan.deepspeed import deepspeed_config
from llmft.plan.engines import ENGINES
from llmft.plan.fsdp import fsdp_plan
from llmft.plan.resolve import load_plan, plan_summary, splits_heads
from llmft.recipe.load import RecipeError


@pytest.fixture
def recipe(tmp_path):
    return write_recipe(
        tmp_path, batch__global_batch_size=8, batch__micro_batch_size=2, model__attn_implementation="sdpa"
    )


def test_global_is_micro_times_accumulation_times_world_over_sp(recipe):
    plan = load_plan(recipe, ["distributed.engine=fsdp", "distributed.sequence_parallel=2"], nproc_per_node=4)
    b = plan.batch
    assert (b.micro_batch_size, b.gradient_accumulation_steps, b.dp_size, b.sp) == (2, 2, 2, 2)
    assert b.equation() == "micro 2 x accumulation 2 x data-parallel 2 (world 4 / sequence-parallel 2) = global 8"
    assert (plan.layout.world_size, plan.layout.dp_size, plan.sequence_parallel) == (4, 2, 2)
    assert [plan.layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # consecutive ranks share sequences
    assert [plan.layout.sp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert fsdp_plan(plan).mesh.shard == 4  # parameters sharded over every rank, sequence ranks included
    assert BatchPlan.from_dict(b.to_dict()) == b


def test_the_default_is_one_and_changes_nothing(recipe):
    plan = load_plan(recipe, ["distributed.engine=fsdp"], nproc_per_node=2)
    assert plan.sequence_parallel == 1 and plan.batch.dp_size == 2
    assert "sequence" not in plan.batch.equation() and "sequence_parallel" not in plan.batch.to_dict()
    assert plan_summary(plan)["sequence_parallel"] == 1


def test_compile_writes_n_into_plan_yaml_and_ds_config(recipe, tmp_path, monkeypatch):
    plan = load_plan(
        recipe,
        ["distributed.engine=deepspeed", "distributed.zero_stage=3", "distributed.sequence_parallel=2"],
        nproc_per_node=4,
    )
    out = tmp_path / "compiled"
    compile_recipe(plan, out)
    assert yaml.safe_load((out / "plan.yaml").read_text())["sequence_parallel"] == 2
    config = json.loads((out / "ds_config.json").read_text())
    assert config["sequence_parallel_size"] == 2 and config == deepspeed_config(plan)
    # DeepSpeed's own parser counts world / N data-parallel ranks in train_batch_size, as llmft does.
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda group=None: 4)
    parsed = DeepSpeedConfig(config)
    assert parsed.world_size == 2 and parsed.train_batch_size == 8
    assert parsed.gradient_accumulation_steps == 2 and parsed.train_micro_batch_size_per_gpu == 2


def test_a_world_n_does_not_divide_is_refused_naming_the_valid_n(recipe):
    with pytest.raises(RecipeError) as e:
        load_plan(recipe, ["distributed.engine=fsdp", "distributed.sequence_parallel=3"], nproc_per_node=4)
    assert "3 does not divide the world size 4. Choose one of 1, 2 or 4." in str(e.value)


def test_heads_n_cannot_split_are_refused_naming_the_valid_n(recipe):
    # TINY_LLAMA: 4 heads, 2 KV heads; 8 ranks: sp 8 does not split 4 heads.
    with pytest.raises(RecipeError) as e:
        load_plan(recipe, ["distributed.engine=fsdp", "distributed.sequence_parallel=8"], nproc_per_node=8)
    assert "8 cannot split the model's 4 attention heads (2 KV heads)" in str(e.value)
    assert "Choose one of 1, 2 or 4 that divides the world size 8." in str(e.value)


def test_kv_heads_fewer_than_n_are_replicated_when_n_is_a_multiple_of_them():
    assert splits_heads(4, 1, 2) and splits_heads(32, 8, 16) and splits_heads(4, 2, 4)
    assert not splits_heads(6, 3, 2)  # 2 neither divides 3 KV heads nor is a multiple of them
    assert not splits_heads(4, 2, 3)


def test_an_engine_without_sequence_parallelism_is_a_user_error_naming_those_with(recipe):
    able = [s.name for s in ENGINES if s.sequence_parallel]
    assert able == ["ddp", "fsdp", "deepspeed"]
    with pytest.raises(RecipeError) as e:
        load_plan(recipe, ["distributed.engine=single", "distributed.sequence_parallel=2"], nproc_per_node=2)
    assert "the single engine has no sequence parallelism. Set distributed.engine=ddp, fsdp or deepspeed" in str(
        e.value
    )


def test_auto_keeps_its_choice_every_multi_rank_engine_runs_it(recipe):
    plan = load_plan(recipe, ["peft.method=lora", "distributed.sequence_parallel=2"], nproc_per_node=2)
    assert plan.engine == "ddp" and plan.batch.dp_size == 1 and plan.layout.world_size == 2


def test_another_world_size_re_solves_with_the_sequence_groups(recipe):
    plan = load_plan(
        recipe, ["distributed.engine=fsdp", "distributed.sequence_parallel=2"], nproc_per_node=4, world_size=2
    )
    b = plan.batch
    assert (b.global_batch_size, b.micro_batch_size, b.gradient_accumulation_steps, b.dp_size, b.sp) == (8, 2, 4, 1, 2)


def test_eager_attention_is_refused(recipe):
    with pytest.raises(RecipeError) as e:
        load_plan(
            recipe,
            ["distributed.engine=fsdp", "distributed.sequence_parallel=2", "model.attn_implementation=eager"],
            nproc_per_node=2,
        )
    assert "eager attention cannot run sequence-parallel here" in str(e.value)
    assert "Set model.attn_implementation to sdpa, flash_attention_2, varlen_sdpa or auto." in str(e.value)


def test_a_reward_model_and_a_precomputed_reference_resolve_with_sp(recipe):
    sp = ["distributed.engine=fsdp", "distributed.sequence_parallel=2"]
    reward = load_plan(recipe, [*sp, "train.objective=reward", "peft.method=lora"], nproc_per_node=2)
    assert (reward.objective, reward.layout.sp, reward.layout.dp_size) == ("reward", 2, 1)
    dpo = [*sp, "train.objective=dpo", "peft.method=lora", "preference.precompute_reference=true"]
    assert load_plan(recipe, dpo, nproc_per_node=2).layout.sp == 2
