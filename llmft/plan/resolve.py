"""``(recipe, world) -> RunPlan``: every decision llmft takes about a run, made once, frozen.

The recipe is the user's intent and is never changed. This module reads it together with
the world the run has (``nnodes x nproc_per_node`` from the recipe or the command line at
compile time, the launcher's world size at run time) and decides:

- the engine (``distributed.engine: auto`` made concrete);
- the batch: ``global = micro x accumulation x dp`` solved exactly (``auto`` micro-batches
  picked by the memory planner), re-solved for a world size other than the compiled one;
- how the model is built: whole on every rank, on the meta device (FSDP2), or under
  ``zero.Init`` (ZeRO-3), and the storage dtype of packed 4-bit weights.

Everything downstream (compilers, engines, the run) reads the ``RunPlan``. Problems that
depend on the world (an engine that cannot run on N processes, a batch that does not
split) are collected with the recipe's own and reported with where each key was set.
Pure: no torch.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any, Callable

from llmft.errors import Problem, UserError
from llmft.plan import memory
from llmft.plan.batch import BatchError, BatchPlan, divisors, resolve_for_world, sequences_from_tokens, solve_batch
from llmft.plan.engines import ENGINES, EngineSpec, choose_engine, engine_spec, load
from llmft.plan.kernels import recipe_problems
from llmft.plan.layout import ParallelLayout, RunPlan, World, parallel_layout, quant_storage_for
from llmft.plan.moe_recipe import moe_problems
from llmft.plan.objectives import (
    group_problems,
    load_objective_module,
    objective_of,
    objective_problems,
    reference_kind,
    unknown_objective,
)
from llmft.plan.shape import model_shape
from llmft.plan.vllm import eval_generate_problems, vllm_world_problems
from llmft.recipe.load import RecipeError, load_unchecked, provenance
from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

# Fresh models (model.config) up to this size are built whole on every rank with the seeded init and
# then sharded, so their weights equal the single-process run's; larger ones and every pretrained model
# are built already sharded (FSDP2: on the meta device, ZeRO-3: under zero.Init). docs/design.md.
WHOLE_INIT_MAX_PARAMS = 1_000_000_000


# --- entry points -------------------------------------------------------------------------------


def load_plan(
    path: Any,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
    launcher: str = "",
    measure_gpu: Callable[[], float | None] | None = None,
) -> RunPlan:
    """Read the recipe and resolve it: for the layout it names (compile, plan), or for the
    world a launcher started (train). Raises ``RecipeError`` listing every problem."""
    recipe, problems = load_unchecked(path, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node)
    return resolve(
        recipe,
        world_size,
        local_world_size=local_world_size,
        launcher=launcher,
        problems=problems,
        measure_gpu=measure_gpu,
    )


def resolve(
    recipe: Recipe,
    world_size: int | None = None,
    *,
    local_world_size: int | None = None,
    launcher: str = "",
    problems: list[Problem] | None = None,
    measure_gpu: Callable[[], float | None] | None = None,
) -> RunPlan:
    """Decide engine, batch and model build for ``recipe`` on ``world_size`` processes (default:
    the layout it names).

    ``world_size`` given (``llmft train``): the world the launcher started is the truth
    (``launched_world``), whatever ``distributed.nnodes`` / ``nproc_per_node`` say; where the recipe
    sets them otherwise, a note names both. Three batch numbers that hold for the launched world are
    used as given; three that hold only for the recipe's layout (a compiled plan) are re-solved for
    the launched world, the global batch kept; neither is an error naming both layouts.
    ``local_world_size``: processes per node (None: the launcher does not say); ``launcher``: its
    name, for the messages (``llmft.job.dist.DistEnv.launcher``).

    ``problems``: the recipe's own, found while loading it; reported together with these.
    ``measure_gpu``: the runtime's measurement of GPU memory in GiB (``llmft.job.gpu``), asked when
    ``micro_batch_size: auto`` needs a number and ``distributed.gpu_memory_gb`` is unset."""
    problems = list(problems or [])
    where = provenance(recipe)
    try:
        load_objective_module(recipe)  # a user's objective registers itself before its name is read
    except UserError as e:
        problems += [Problem(where(pr.where), pr.what, pr.fix) for pr in e.problems]
    unknown = unknown_objective(recipe, where)
    if unknown:  # every check below reads the objective's record
        raise RecipeError(*problems, *unknown, title=f"the recipe has {len(problems) + 1} problem(s)")
    compiled = World.of(recipe)
    world = compiled if world_size is None else launched_world(compiled, world_size, local_world_size)
    disagreement = layout_disagreement(recipe, world, launcher) if world_size is not None else []
    notes: list[str] = [*disagreement]
    engine = choose_engine(recipe, world.size)
    spec = engine_spec(engine)
    layout, layout_problems = parallel_layout(recipe, spec, world.size, where)  # every parallel dimension, sized once
    if recipe.data.max_seq_len == "auto":
        try:
            recipe, note = _planned_seq_len(recipe, engine, layout, measure_gpu)
            notes.append(note)
        except UserError as e:
            problems += [Problem(where(pr.where), pr.what, pr.fix) for pr in e.problems]
            recipe = _with_seq_len(recipe, 2)  # to go on and report every other problem too
    problems += world_problems(recipe, spec, world.size, where) + layout_problems + moe_problems(recipe, where)
    problems += eval_generate_problems(recipe, where) + vllm_world_problems(recipe, world.size, where)
    batch = None
    try:
        batch, note = _solve(recipe, engine, compiled, world, measure_gpu, layout)
        if note:
            notes.append(note)
    except UserError as e:
        said = f" ({'; '.join(disagreement)})" if disagreement else ""  # the batch was set for the recipe's layout
        problems += [
            Problem(where(pr.where) if pr.where.startswith("batch.") else pr.where, pr.what + said, pr.fix)
            for pr in e.problems
        ]
    if batch is not None:
        problems += group_problems(objective_of(recipe), recipe, batch, where)
    if problems:
        raise RecipeError(*problems, title=f"the recipe has {len(problems)} problem(s)")
    assert batch is not None
    return RunPlan(
        recipe=recipe,
        world=world,
        engine=engine,
        batch=batch,
        layout=layout,
        quant_storage=quant_storage_for(recipe, spec),
        builds_whole=builds_whole(recipe),
        notes=tuple(notes),
        objective=recipe.train.objective,
        reference=reference_kind(recipe),
        chunked_loss=memory.chunked_loss_on(recipe, batch.micro_batch_size),
    )


# --- the launched world ------------------------------------------------------------------------

# How messages name the launcher that started the processes (``llmft.job.dist.DistEnv.launcher``).
LAUNCHERS = {"torchrun": "torchrun", "deepspeed": "the deepspeed launcher", "srun": "srun"}


def launched_world(compiled: World, world_size: int, local_world_size: int | None) -> World:
    """The world the launcher started. Where it does not say how its processes sit on nodes
    (``local_world_size`` None) and the recipe's layout has the same size, that layout is kept."""
    if local_world_size is None and world_size == compiled.size:
        return compiled
    return World.running(world_size, local_world_size)


def layout_disagreement(recipe: Recipe, world: World, launcher: str) -> list[str]:
    """What the recipe (or ``--nnodes`` / ``--nproc-per-node`` of the compile that wrote it) says
    about the layout and the launch does not: one line per key the recipe sets otherwise."""
    sources = getattr(recipe, "_provenance", None)
    set_keys = getattr(sources, "where", {})
    d = recipe.distributed
    out = []
    for key, said, started, unit in (
        ("distributed.nproc_per_node", d.nproc_per_node, world.nproc_per_node, "processes per node"),
        ("distributed.nnodes", d.nnodes, world.nnodes, "node(s)"),
    ):
        if said == started or key not in set_keys:
            continue
        if world.size == 1 and launcher in ("", "none"):
            out.append(f"{key} is {said} in the recipe, but llmft train runs as one process (no launcher): using 1")
        else:
            who = LAUNCHERS.get(launcher, "the launcher")
            out.append(f"{key} is {said} in the recipe, but {who} started {started} {unit}: using {started}")
    return out


def builds_whole(recipe: Recipe) -> bool:
    """Whether a sharding engine may build this recipe's model whole on every rank before sharding it."""
    shape = model_shape(recipe.model)
    return recipe.model.config is not None and shape is not None and shape.num_params <= WHOLE_INIT_MAX_PARAMS


# --- the batch ----------------------------------------------------------------------------------


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"


def _solve(
    recipe: Recipe,
    engine: str,
    compiled: World,
    world: World,
    measure_gpu: Callable[[], float | None] | None,
    layout: ParallelLayout,
) -> tuple[BatchPlan, str | None]:
    """Solve the batch equation for ``world`` (``layout.dp_size`` data-parallel ranks: each sequence
    group is one); a plan compiled for another size is re-solved."""
    b = recipe.batch
    g = b.global_batch_size
    if b.global_batch_tokens is not None and recipe.data.packing:
        from_tokens = sequences_from_tokens(b.global_batch_tokens, recipe.data.max_seq_len)
        if not _is_auto(g) and g != from_tokens:
            raise UserError(
                Problem(
                    "batch.global_batch_tokens",
                    f"{b.global_batch_tokens} tokens / max_seq_len {recipe.data.max_seq_len} = {from_tokens} "
                    f"sequences, but batch.global_batch_size is {g}",
                    "Set only one of the two.",
                )
            )
        g = from_tokens
    micro = b.micro_batch_size
    dp, compiled_dp, splits = layout.dp_size, layout.data_parallel_size(compiled.size), layout.splits
    if _is_auto(micro) and _is_auto(b.gradient_accumulation_steps) and isinstance(g, int) and not isinstance(g, bool):
        micro = _planned_micro(recipe, engine, g, layout, measure_gpu)
    values = (g, micro, b.gradient_accumulation_steps)
    if all(isinstance(v, int) for v in values) and compiled_dp != dp:
        try:  # three numbers that hold for the launched world: as given
            return solve_batch(*values, dp_size=dp, splits=splits), None
        except BatchError as launched_error:
            try:  # ... or for the recipe's own layout (a compiled plan): re-solved for the launched world
                planned = solve_batch(*values, dp_size=compiled_dp)
            except BatchError:
                raise launched_error from None  # for neither: the equation of the world that runs
        return resolve_for_world(planned, dp, splits)
    return solve_batch(*values, dp_size=dp, splits=splits), None


def _planned_seq_len(
    recipe: Recipe, engine: str, layout: ParallelLayout, measure_gpu: Callable[[], float | None] | None
) -> tuple[Recipe, str]:
    """``data.max_seq_len: auto``: a copy of the recipe with the longest sequence that fits
    (``memory.longest_sequence``) at the recipe's micro-batch (1 where it is auto), and the note
    that says so. The plan carries the number; ``resolved_recipe`` writes it into recipe.yaml."""
    gpu_gb = recipe.distributed.gpu_memory_gb
    if gpu_gb is None and measure_gpu is not None:
        gpu_gb = measure_gpu()
    micro = recipe.batch.micro_batch_size
    micro = micro if isinstance(micro, int) and not isinstance(micro, bool) else 1
    n = memory.longest_sequence(recipe, engine, layout, gpu_gb, micro) if gpu_gb is not None else 0
    if gpu_gb is None or n < 2:
        raise UserError(
            Problem(
                "data.max_seq_len",
                "auto needs a GPU memory size (distributed.gpu_memory_gb, or a detected GPU)"
                if gpu_gb is None
                else f"auto: not even 2 tokens per sequence fit {gpu_gb:g} GiB per GPU at micro-batch {micro}",
                "Set distributed.gpu_memory_gb (GiB per GPU), or give data.max_seq_len a number."
                if gpu_gb is None
                else "Use LoRA/QLoRA, shard over more GPUs, or give a larger distributed.gpu_memory_gb.",
            )
        )
    log.info("data.max_seq_len=auto: %d tokens is the longest that fits %.0f GiB per GPU", n, gpu_gb)
    note = f"data.max_seq_len=auto: {n} tokens, the longest that fits {gpu_gb:g} GiB per GPU at micro-batch {micro}"
    return _with_seq_len(recipe, n), note


def _with_seq_len(recipe: Recipe, n: int) -> Recipe:
    """A copy of ``recipe`` with ``data.max_seq_len = n``; the copy keeps where each key was set
    (``provenance``), which ``dataclasses.replace`` would drop."""
    out = copy.copy(recipe)
    out.data = replace(recipe.data, max_seq_len=n)
    return out


def _planned_micro(
    recipe: Recipe,
    engine: str,
    global_batch_size: int,
    layout: ParallelLayout,
    measure_gpu: Callable[[], float | None] | None,
) -> int | str:
    """micro_batch_size=auto with accumulation auto: the largest micro-batch that fits the GPU
    (distributed.gpu_memory_gb, or what the runtime measured: compile measures nothing). Without a
    memory size it stays auto and the solver asks for a number."""
    gpu_gb = recipe.distributed.gpu_memory_gb
    if gpu_gb is None and measure_gpu is not None:
        gpu_gb = measure_gpu()
    if gpu_gb is None:
        return "auto"
    micro = memory.pick_micro_batch(recipe, engine, global_batch_size, layout, gpu_gb)
    log.info("batch.micro_batch_size=auto: %d is the largest that fits %.0f GiB per GPU", micro, gpu_gb)
    return micro


# --- combinations that depend on the engine or the world ----------------------------------------


def world_problems(r: Recipe, spec: EngineSpec, world_size: int, where: Callable[[str], str]) -> list[Problem]:
    """Every check of a recipe against the engine and the world it runs on, in the one order they
    are reported (the recipe's own checks ran when it was loaded: ``recipe/validate.py``):

    1. the layout: may this engine run on ``world_size`` processes (``_layout_problems``);
    2. offload: what this engine can move off the GPU (``_offload_problems``);
    3. the engine's own refusals (``EngineSpec.problems``);
    4. quantization on this engine and world (``_quantization_problems``);
    5. the speed switches, from the engine's record (``plan/kernels.py``);
    6. the objective's (``objective_problems``: its head, its record kind, the checks its record
       names, the keys of sections it does not read).

    The parallel dimensions' own checks (sequence parallelism: ``sequence_parallel_problems``) and
    their combinations follow, from ``parallel_layout``.
    """
    own = load(spec.problems)(r, where) if spec.problems else []
    kernels = [Problem(where(pr.where), pr.what, pr.fix) for pr in recipe_problems(r, spec)]
    return (
        _layout_problems(r, spec, world_size, where)
        + _offload_problems(r, spec, where)
        + own
        + _quantization_problems(r, spec, world_size, where)
        + kernels
        + objective_problems(r, where)
    )


# Attention kernels Ulysses runs with packed rows kept apart (llmft.model.ulysses).
SEQUENCE_PARALLEL_ATTENTION = ("sdpa", "flash_attention_2", "varlen_sdpa", "auto")


def sequence_parallel_problems(
    r: Recipe, spec: EngineSpec, world_size: int, where: Callable[[str], str]
) -> list[Problem]:
    """``distributed.sequence_parallel``: an engine that runs it, a world it divides, attention
    heads it splits (KV heads fewer than N are replicated, as ALST does, when N is a multiple of them)."""
    n = r.distributed.sequence_parallel
    if n <= 1:
        return []
    key = where("distributed.sequence_parallel")
    if not spec.sequence_parallel:
        able = [s.name for s in ENGINES if s.sequence_parallel]
        return [
            Problem(
                key,
                f"{n}: the {spec.name} engine has no sequence parallelism",
                f"Set distributed.engine={_or(able)}, or sequence_parallel=1.",
            )
        ]
    p: list[Problem] = []
    if r.model.attn_implementation not in SEQUENCE_PARALLEL_ATTENTION:
        p.append(
            Problem(
                where("model.attn_implementation"),
                f"{r.model.attn_implementation} attention cannot run sequence-parallel here (eager builds a "
                "whole-sequence mask Ulysses cannot split; flex's causal block mask would not keep packed rows apart)",
                f"Set model.attn_implementation to {_or(list(SEQUENCE_PARALLEL_ATTENTION))}.",
            )
        )
    if r.train.eval_generate_samples:
        p.append(
            Problem(
                where("train.eval_generate_samples"),
                f"{r.train.eval_generate_samples}: generation decodes one token at a time, which a sequence "
                "group cannot split",
                "Set train.eval_generate_samples=0 (the eval loss and perplexity run sequence-parallel).",
            )
        )
    if world_size % n:
        valid = divisors(world_size)
        p.append(
            Problem(
                key,
                f"{n} does not divide the world size {world_size}",
                f"Choose one of {_or([str(v) for v in valid])}.",
            )
        )
    shape = model_shape(r.model)
    if shape is not None and not splits_heads(shape.num_heads, shape.num_kv_heads, n):
        valid = [d for d in divisors(shape.num_heads) if splits_heads(shape.num_heads, shape.num_kv_heads, d)]
        p.append(
            Problem(
                key,
                f"{n} cannot split the model's {shape.num_heads} attention heads ({shape.num_kv_heads} KV heads) "
                "over the ranks of a sequence",
                f"Choose one of {_or([str(v) for v in valid])}"
                + (f" that divides the world size {world_size}." if world_size > 1 else "."),
            )
        )
    return p


def splits_heads(heads: int, kv_heads: int, n: int) -> bool:
    """Ulysses gives each of ``n`` ranks ``heads / n`` query heads; KV heads are split the same
    way, or replicated when ``n`` is a multiple of their number."""
    return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)


def _or(names: list[str]) -> str:
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


# Engine-specific settings (recipe key, the value that asks nothing, what a set value is called):
# an engine that does not honour one (EngineSpec.settings) would silently ignore it.
_ENGINE_SETTINGS = (
    ("distributed.fsdp_grad_sync", "boundary", "{value} is"),
    ("distributed.hsdp_replicate", 1, "HSDP replica groups are"),
)


def _layout_problems(r: Recipe, spec: EngineSpec, dp_size: int, where: Callable[[str], str]) -> list[Problem]:
    p: list[Problem] = []
    d = r.distributed
    if not spec.multi_rank and dp_size > 1:
        p.append(
            Problem(
                where("distributed.engine"),
                f"{spec.name} cannot run on {dp_size} processes",
                f"Use distributed.engine={_or([s.name for s in ENGINES if s.multi_rank])} (or auto).",
            )
        )
    if dp_size % d.hsdp_replicate:
        p.append(
            Problem(
                where("distributed.hsdp_replicate"),
                f"{d.hsdp_replicate} does not divide data-parallel size {dp_size}",
                f"Choose a divisor of {dp_size}.",
            )
        )
    for key, default, what in _ENGINE_SETTINGS:
        value = getattr(d, key.split(".")[1])
        if value != default and not spec.honours(key):
            (owner,) = (s for s in ENGINES if s.honours(key))
            p.append(
                Problem(
                    where(key),
                    f"{what.format(value=value)} an {owner.title} setting; engine is {spec.name}, which would ignore it",
                    f"Set distributed.engine={owner.name}, or {key}={default}.",
                )
            )
    return p


def _offload_problems(r: Recipe, spec: EngineSpec, where: Callable[[str], str]) -> list[Problem]:
    p: list[Problem] = []
    d = r.distributed
    if d.offload_params != "none" and not spec.param_offload:
        sharding = [s.name + (" with zero_stage=3" if s.zero_stages else "") for s in ENGINES if s.param_offload]
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"the {spec.name} engine keeps whole replicas and cannot offload parameters",
                f"Use distributed.engine={_or(sharding)}.",
            )
        )
    wanted = {d.offload_params, d.offload_optimizer} - {"none"}
    if spec.param_offload and not wanted <= set(spec.param_offload) | set(spec.optimizer_offload):
        others = [s.name for s in ENGINES if wanted <= set(s.param_offload)]
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"{spec.title} offloads to {_or(list(spec.param_offload))} only",
                f"Use {_or(list(spec.param_offload))}, or distributed.engine={_or(others)} for "
                f"{_or(sorted(wanted - set(spec.param_offload)))}.",
            )
        )
    if d.offload_optimizer != "none" and not spec.optimizer_offload:
        able = [s.title for s in ENGINES if s.optimizer_offload]
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                f"optimizer offload needs {_or(able)}, engine is {spec.name}",
                f"Set distributed.engine={_or([s.name for s in ENGINES if s.optimizer_offload])}, or "
                "offload_optimizer=none (FSDP: use offload_params=cpu).",
            )
        )
    return p


def _quantization_problems(r: Recipe, spec: EngineSpec, dp_size: int, where: Callable[[str], str]) -> list[Problem]:
    p: list[Problem] = []
    m = r.model
    q = m.quantization
    if q is not None and q.bits == 8 and spec.int8_max_ranks is not None and dp_size > spec.int8_max_ranks:
        p.append(
            Problem(
                where("model.quantization.bits"),
                f"8-bit weights cannot be sharded by {spec.name}",
                f"Use bits: 4 (its storage dtype can be sharded) or distributed.engine="
                f"{_or([s.name for s in ENGINES if s.int8_max_ranks is None and s.multi_rank])}.",
            )
        )
    if q is not None and spec.shards_parameters(r) and q.quant_storage not in (None, m.dtype):
        p.append(
            Problem(
                where("model.quantization.quant_storage"),
                f"{q.quant_storage} differs from model.dtype {m.dtype}: {spec.sharded_title} shards 4-bit weights "
                "only when they are stored in the dtype of the other parameters",
                f"Set model.quantization.quant_storage={m.dtype} or null (null picks it automatically).",
            )
        )
    return p


# Where ``plan_summary`` is written: a compiled dir (llmft compile) and every checkpoint.
PLAN_FILE = "plan.yaml"


def plan_summary(plan: RunPlan) -> dict[str, Any]:
    """The decisions as plain data (``plan.yaml`` of a compiled dir, trackers)."""
    return {
        "engine": plan.engine,
        **({"zero_stage": plan.zero_stage} if plan.spec.zero_stages else {}),
        "world": {"nnodes": plan.world.nnodes, "nproc_per_node": plan.world.nproc_per_node},
        "sequence_parallel": plan.sequence_parallel,
        "batch": {**plan.batch.to_dict(), "equation": plan.batch.equation()},
        "dtype": plan.dtype,
        "quant_storage": plan.quant_storage,
        "model_init": "meta" if plan.meta_init else "zero_init" if plan.zero_init else "whole",
        "chunked_loss": plan.chunked_loss,
        "objective": plan.objective,
        **({"reference": plan.reference} if plan.objective_spec.pairs else {}),
        "notes": list(plan.notes),
    }


def describe_engine(plan: RunPlan) -> str:
    """``fsdp``, ``deepspeed (ZeRO-3)``: for banners and reports."""
    return plan.spec.describe(plan.zero_stage)
