"""The engine registry (llmft/plan/engines.py): every record resolves, and nothing else in llmft/
decides by comparing engine names. The RunPlan's parallel layout is what the records say."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from helpers import COMPILE_RECIPE

from llmft.plan.engines import AUTO, ENGINE_NAMES, ENGINES, choose_engine, engine_spec, load, one_process_engine
from llmft.plan.resolve import load_plan
from llmft.recipe.schema import DistributedConfig

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "llmft/plan/engines.py"
NAME = "|".join(re.escape(n) for n in ENGINE_NAMES)
# `x == "fsdp"`, `"ddp" != x`, `case "fsdp":`; `in ("single", "ddp")`, `not in [..., "deepspeed"]`
# unless it is a loop's `for x in (...)`.
COMPARISON = re.compile(rf"""(==|!=)\s*["']({NAME})["']|["']({NAME})["']\s*(==|!=)|\bcase\s+["']({NAME})["']""")
MEMBERSHIP = re.compile(rf"""\bin\s*[(\[{{][^)\]}}]*["']({NAME})["']""")


def decides_by_name(line: str) -> bool:
    code = line.split("#")[0]
    if COMPARISON.search(code):
        return True
    return any(not re.search(r"\bfor\s+[\w, ()]+$", code[: m.start()]) for m in MEMBERSHIP.finditer(code))


def test_no_engine_name_is_compared_outside_the_registry():
    found = []
    for path in sorted((ROOT / "llmft").rglob("*.py")):
        if path == REGISTRY:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if decides_by_name(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "decide by the engine's record (llmft.plan.engines), not its name:\n" + "\n".join(found)


def test_the_check_catches_what_it_is_for():
    for line in ('if engine == "fsdp":', 'x = "ddp" != e', 'if e in ("single", "ddp"):', 'e not in ["deepspeed"]'):
        assert decides_by_name(line), line
    for line in ('DS_DIR = "deepspeed"', 'for pkg in ("torch", "deepspeed"):', 'name="fsdp",'):
        assert not decides_by_name(line), line


@pytest.mark.parametrize("spec", ENGINES, ids=ENGINE_NAMES)
def test_every_record_resolves(spec):
    """Each dotted path a record names imports; the runtime class has the Engine methods."""
    assert engine_spec(spec.name) is spec
    runtime = load(spec.runtime)
    for method in ("micro_step", "backward", "step", "unwrap", "autocast", "save", "load"):
        assert callable(getattr(runtime, method, None)), f"{spec.runtime} lacks {method}"
    for path in (spec.reader, spec.stream_reader, spec.config_files, spec.summary, spec.problems, spec.universal):
        if path is not None:
            assert callable(load(path)), path
    assert bool(spec.config_files) == bool(spec.config_names)
    assert spec.sharded_checkpoint == (spec.stream_reader is not None)


def test_registry_lookups():
    assert one_process_engine().name in ENGINE_NAMES and not one_process_engine().multi_rank
    with pytest.raises(AssertionError, match="unknown engine 'megatron'"):
        engine_spec("megatron")


def test_the_recipe_allows_the_registry_names_and_auto():
    """recipe/ may not import plan/: its list of names is checked against the registry here."""
    (engine,) = (f for f in dataclasses.fields(DistributedConfig) if f.name == "engine")
    assert engine.metadata["choices"] == (AUTO, *ENGINE_NAMES)


LAYOUTS = [
    # (overrides, world size) -> engine, parameters sharded, replica groups, ranks per shard group
    ([], 1, "single", False, 1, 1),
    ([], 2, "fsdp", True, 1, 2),  # auto: a full fine-tune on several ranks
    (["peft.method=lora"], 2, "ddp", False, 1, 1),
    (["distributed.engine=fsdp", "distributed.hsdp_replicate=2"], 4, "fsdp", True, 2, 2),
    (["distributed.engine=deepspeed", "distributed.zero_stage=2"], 2, "deepspeed", False, 1, 1),
    (["distributed.engine=deepspeed", "distributed.zero_stage=3"], 2, "deepspeed", True, 1, 2),
]


@pytest.mark.parametrize("overrides,world,engine,sharded,replicate,shard", LAYOUTS)
def test_parallel_layout(tmp_path, overrides, world, engine, sharded, replicate, shard):
    path = tmp_path / "recipe.yaml"
    path.write_text(COMPILE_RECIPE)
    plan = load_plan(path, overrides, nproc_per_node=world)
    assert plan.engine == engine == choose_engine(plan.recipe, world)
    layout = plan.layout
    assert (layout.dp_size, layout.shards_params, layout.dp_replicate, layout.dp_shard) == (
        world,
        sharded,
        replicate,
        shard,
    )
    one = plan.on_one_process()
    assert one.engine == one_process_engine().name and not one.layout.shards_params
    assert one.layout.dp_size == world  # the ranks are emulated


MESHES = [
    # (overrides, world size) -> the named dimensions of the run, and those FSDP2 shards parameters on
    ([], 2, (("replicate", 1), ("shard", 2), ("sp", 1)), (("shard", 2),)),
    (
        ["distributed.engine=fsdp", "distributed.hsdp_replicate=2"],
        4,
        (("replicate", 2), ("shard", 2), ("sp", 1)),
        (("replicate", 2), ("shard", 2)),
    ),
    (
        ["distributed.engine=fsdp", "distributed.sequence_parallel=2", "model.attn_implementation=sdpa"],
        4,
        (("replicate", 1), ("shard", 2), ("sp", 2)),
        (("shard", 4),),
    ),
    (["peft.method=lora", "distributed.engine=ddp"], 2, (("replicate", 1), ("shard", 2), ("sp", 1)), (("shard", 1),)),
]


@pytest.mark.parametrize("overrides,world,mesh,param_mesh", MESHES)
def test_the_layout_is_one_named_mesh(tmp_path, overrides, world, mesh, param_mesh):
    """The layout names every parallel dimension (ranks are row-major over them: a rank's sequence
    group and slice are its coordinates), and FSDP2's mesh is the layout's."""
    from llmft.plan.fsdp import fsdp_plan

    path = tmp_path / "recipe.yaml"
    path.write_text(COMPILE_RECIPE)
    layout = load_plan(path, overrides, nproc_per_node=world).layout
    assert layout.mesh == mesh and layout.param_mesh == param_mesh
    sizes = dict(mesh)
    assert sizes["replicate"] * sizes["shard"] * sizes["sp"] == world == layout.world_size
    for rank in range(world):
        assert (layout.dp_rank(rank), layout.sp_rank(rank)) == divmod(rank, sizes["sp"])
    if layout.shards_params:
        plan_mesh = fsdp_plan(load_plan(path, overrides, nproc_per_node=world)).mesh
        assert (plan_mesh.replicate, plan_mesh.shard) == (
            dict(param_mesh).get("replicate", 1),
            dict(param_mesh)["shard"],
        )
