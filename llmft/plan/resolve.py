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
from dataclasses import dataclass, replace
from typing import Any, Callable

from llmft.errors import Problem, UserError
from llmft.plan.batch import BatchPlan, resolve_for_world, sequences_from_tokens, solve_batch
from llmft.plan.shape import model_shape
from llmft.recipe.load import RecipeError, load_unchecked, provenance, unresolve_env
from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

# Fresh models (model.config) up to this size are built whole on every rank with the seeded init and
# then sharded, so their weights equal the single-process run's; larger ones and every pretrained model
# are built already sharded (FSDP2: on the meta device, ZeRO-3: under zero.Init). docs/design.md.
WHOLE_INIT_MAX_PARAMS = 1_000_000_000


@dataclass(frozen=True)
class World:
    """How many processes the run has, and how they sit on nodes."""

    nnodes: int = 1
    nproc_per_node: int = 1

    @property
    def size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @classmethod
    def of(cls, recipe: Recipe) -> World:
        """The layout the recipe (and ``--nnodes`` / ``--nproc-per-node``) names: compile time."""
        return cls(recipe.distributed.nnodes, recipe.distributed.nproc_per_node)

    @classmethod
    def running(cls, world_size: int, local_world_size: int | None = None) -> World:
        """The layout a launcher started (``local_world_size``: processes on this node)."""
        local = local_world_size if local_world_size and world_size % local_world_size == 0 else world_size
        return cls(world_size // local, local)


@dataclass(frozen=True)
class RunPlan:
    """The resolved run. ``recipe`` is the intent as the user wrote it; the rest are decisions."""

    recipe: Recipe
    world: World
    engine: str  # single, ddp, fsdp, deepspeed
    batch: BatchPlan
    # Packed 4-bit weights: stored as this dtype. Engines that shard parameters (FSDP2, ZeRO-3)
    # partition tensors of one dtype, so there they are viewed as the compute dtype; elsewhere uint8.
    quant_storage: str | None
    # A fresh model small enough to be built whole on every rank with the seeded init (then
    # sharded): its weights equal the single-process run's on every engine and world size.
    builds_whole: bool
    notes: tuple[str, ...] = ()  # what resolving changed, for the log

    @property
    def dp_size(self) -> int:
        return self.batch.dp_size

    @property
    def zero_stage(self) -> int:
        return self.recipe.distributed.zero_stage

    @property
    def dtype(self) -> str:
        """The compute dtype (``model.dtype``)."""
        return self.recipe.model.dtype

    @property
    def peft(self) -> bool:
        return self.recipe.peft.method != "none"

    @property
    def meta_init(self) -> bool:
        """The model is built on the meta device and each rank loads only its shards: FSDP2 (a
        pretrained model, a 4-bit one included, or a fresh one too big to build whole) and ZeRO-3
        (a pretrained model, a 4-bit one included: ``engines/zero3_init.py``)."""
        if self.builds_whole:
            return False
        q = self.recipe.model.quantization
        pretrained = self.recipe.model.config is None
        if self.engine == "fsdp":
            return q is None or (q.bits == 4 and pretrained)
        if self.engine == "deepspeed" and self.zero_stage == 3:
            return pretrained and (q is None or q.bits == 4)
        return False

    @property
    def zero_init(self) -> bool:
        """ZeRO-3 builds the model partitioned under ``zero.Init``: a fresh model too big to build
        whole (a quantized one is still built whole: transformers does not enter ``zero.Init`` then)."""
        return self.engine == "deepspeed" and self.zero_stage == 3 and not self.builds_whole and not self.meta_init

    @property
    def shards_params(self) -> bool:
        """The engine partitions the parameters themselves (FSDP2, ZeRO-3), not only their state."""
        return shards_params(self.engine, self.zero_stage)

    @property
    def upcast_unquantized(self) -> bool:
        """QLoRA: PEFT's k-bit preparation upcasts norms, embeddings and head to fp32, except
        where the engine shards parameters (FSDP2, ZeRO-3): they stay in the compute dtype, the
        dtype the packed 4-bit weights are stored in, so every sharded tensor has one dtype."""
        return not self.shards_params

    @property
    def chunked_loss(self) -> bool:
        """The LM head and loss run in chunks of tokens (``llmft.loss``)."""
        from llmft.plan.memory import chunked_loss_on

        return chunked_loss_on(self.recipe, self.batch.micro_batch_size)

    def on_one_process(self) -> RunPlan:
        """The same run built as one process would build it (``llmft verify`` emulates the ranks)."""
        return replace(self, engine="single", quant_storage=quant_storage_for(self.recipe, "single"))

    def resolved_recipe(self) -> Recipe:
        """A copy of the recipe with the decisions written in (engine, batch, layout): what
        ``recipe.yaml`` files hold, so that a compiled dir or a checkpoint says what ran.
        ``${oc.env:...}`` values stay as typed: they are resolved again when the file is read."""
        r = copy.deepcopy(self.recipe)
        r.distributed.engine = self.engine
        r.distributed.nnodes, r.distributed.nproc_per_node = self.world.nnodes, self.world.nproc_per_node
        r.batch.global_batch_size = self.batch.global_batch_size
        r.batch.micro_batch_size = self.batch.micro_batch_size
        r.batch.gradient_accumulation_steps = self.batch.gradient_accumulation_steps
        unresolve_env(r)  # values read from the environment (secrets) are written as typed, not resolved
        return r


# --- entry points -------------------------------------------------------------------------------


def load_plan(
    path: Any,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
) -> RunPlan:
    """Read the recipe and resolve it: for the layout it names (compile, plan), or for the
    world a launcher started (train). Raises ``RecipeError`` listing every problem."""
    recipe, problems = load_unchecked(path, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node)
    return resolve(recipe, world_size, local_world_size=local_world_size, problems=problems)


def resolve(
    recipe: Recipe,
    world_size: int | None = None,
    *,
    local_world_size: int | None = None,
    problems: list[Problem] | None = None,
) -> RunPlan:
    """Decide engine, batch and model build for ``recipe`` on ``world_size`` processes (default:
    the layout it names; another size re-solves a batch compiled for that layout).

    ``problems``: the recipe's own, found while loading it; reported together with these."""
    problems = list(problems or [])
    where = provenance(recipe)
    compiled = World.of(recipe)
    same = world_size is None or world_size == compiled.size
    world = compiled if same else World.running(world_size, local_world_size)
    engine = resolve_engine(recipe, world.size)
    problems += engine_problems(recipe, engine, world.size, where)
    batch, notes = None, []
    try:
        batch, note = _solve(recipe, engine, compiled, world)
        if note:
            notes.append(note)
    except UserError as e:
        problems += [
            Problem(where(pr.where) if pr.where.startswith("batch.") else pr.where, pr.what, pr.fix)
            for pr in e.problems
        ]
    if problems:
        raise RecipeError(*problems, title=f"the recipe has {len(problems)} problem(s)")
    assert batch is not None
    return RunPlan(
        recipe=recipe,
        world=world,
        engine=engine,
        batch=batch,
        quant_storage=quant_storage_for(recipe, engine),
        builds_whole=builds_whole(recipe),
        notes=tuple(notes),
    )


def resolve_engine(r: Recipe, dp_size: int) -> str:
    """``auto``: one process -> single; several -> deepspeed when offloading, fsdp for a full
    fine-tune (the replicas would not fit), ddp for adapters (small gradients)."""
    d = r.distributed
    if d.engine != "auto":
        return d.engine
    if dp_size == 1:
        return "single"
    if d.offload_optimizer != "none" or d.offload_params == "nvme":
        return "deepspeed"
    if r.peft.method == "none" or d.offload_params == "cpu":
        return "fsdp"
    return "ddp"


def builds_whole(recipe: Recipe) -> bool:
    """Whether a sharding engine may build this recipe's model whole on every rank before sharding it."""
    shape = model_shape(recipe.model)
    return recipe.model.config is not None and shape is not None and shape.num_params <= WHOLE_INIT_MAX_PARAMS


def shards_params(engine: str, zero_stage: int) -> bool:
    """FSDP2 and ZeRO-3 partition the parameters themselves across ranks."""
    return engine == "fsdp" or (engine == "deepspeed" and zero_stage == 3)


def quant_storage_for(recipe: Recipe, engine: str) -> str | None:
    """How packed 4-bit weights are stored on ``engine`` (None: not 4-bit). Where parameters are
    sharded (FSDP2, ZeRO-3) the packed bytes are viewed as the compute dtype, as HF/PEFT, Axolotl
    and LLaMA-Factory do with ``bnb_4bit_quant_storage``; elsewhere plain uint8."""
    q = recipe.model.quantization
    if q is None or q.bits != 4:
        return None
    if q.quant_storage is not None:
        return q.quant_storage
    return recipe.model.dtype if shards_params(engine, recipe.distributed.zero_stage) else "uint8"


# --- the batch ----------------------------------------------------------------------------------


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"


def _solve(recipe: Recipe, engine: str, compiled: World, world: World) -> tuple[BatchPlan, str | None]:
    """Solve the batch equation for ``world``; a plan compiled for another size is re-solved."""
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
    if _is_auto(micro) and _is_auto(b.gradient_accumulation_steps) and isinstance(g, int) and not isinstance(g, bool):
        micro = _planned_micro(recipe, engine, g, world.size)
    values = (g, micro, b.gradient_accumulation_steps)
    if all(isinstance(v, int) for v in values) and compiled.size != world.size:
        return resolve_for_world(solve_batch(*values, dp_size=compiled.size), world.size)
    return solve_batch(*values, dp_size=world.size), None


def _planned_micro(recipe: Recipe, engine: str, global_batch_size: int, dp_size: int) -> int | str:
    """micro_batch_size=auto with accumulation auto: the largest micro-batch that fits the GPU
    (distributed.gpu_memory_gb, or the detected device when torch is already loaded: compile never
    imports it). Without a memory size it stays auto and the solver asks for a number."""
    import sys

    from llmft.plan import memory

    gpu_gb = recipe.distributed.gpu_memory_gb
    if gpu_gb is None and "torch" in sys.modules:
        gpu_gb = memory.detected_gpu_memory_gb()
    if gpu_gb is None:
        return "auto"
    micro = memory.pick_micro_batch(recipe, engine, global_batch_size, dp_size, gpu_gb)
    log.info("batch.micro_batch_size=auto: %d is the largest that fits %.0f GiB per GPU", micro, gpu_gb)
    return micro


# --- combinations that depend on the engine or the world ----------------------------------------


def engine_problems(r: Recipe, engine: str, dp_size: int, where: Callable[[str], str]) -> list[Problem]:
    """What this engine cannot do with this recipe on ``dp_size`` processes."""
    from llmft.plan.kernels import recipe_problems  # the speed switches' own refusals

    kernels = [Problem(where(pr.where), pr.what, pr.fix) for pr in recipe_problems(r, engine)]
    return (
        _layout_problems(r, engine, dp_size, where)
        + _offload_problems(r, engine, where)
        + _quantization_problems(r, engine, dp_size, where)
        + kernels
    )


def _layout_problems(r: Recipe, engine: str, dp_size: int, where: Callable[[str], str]) -> list[Problem]:
    p: list[Problem] = []
    d = r.distributed
    if engine == "single" and dp_size > 1:
        p.append(
            Problem(
                where("distributed.engine"),
                f"single cannot run on {dp_size} processes",
                "Use distributed.engine=ddp, fsdp or deepspeed (or auto).",
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
    if d.fsdp_grad_sync != "boundary" and engine != "fsdp":
        p.append(
            Problem(
                where("distributed.fsdp_grad_sync"),
                f"{d.fsdp_grad_sync} is an FSDP2 setting; engine is {engine}, which would ignore it",
                "Set distributed.engine=fsdp, or distributed.fsdp_grad_sync=boundary.",
            )
        )
    if d.hsdp_replicate > 1 and engine != "fsdp":
        p.append(
            Problem(
                where("distributed.hsdp_replicate"),
                f"HSDP replica groups are an FSDP2 setting; engine is {engine}, which would ignore it",
                "Set distributed.engine=fsdp, or distributed.hsdp_replicate=1.",
            )
        )
    return p


def _offload_problems(r: Recipe, engine: str, where: Callable[[str], str]) -> list[Problem]:
    p: list[Problem] = []
    d = r.distributed
    if d.offload_params != "none" and engine in ("single", "ddp"):
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"the {engine} engine keeps whole replicas and cannot offload parameters",
                "Use distributed.engine=fsdp or deepspeed with zero_stage=3.",
            )
        )
    if d.offload_params != "none" and engine == "deepspeed" and d.zero_stage != 3:
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"needs ZeRO stage 3, got {d.zero_stage}",
                "Set distributed.zero_stage=3 or distributed.offload_params=none.",
            )
        )
    if engine == "fsdp" and "nvme" in (d.offload_params, d.offload_optimizer):
        p.append(
            Problem(
                where("distributed.offload_params"),
                "FSDP2 offloads to cpu only",
                "Use cpu, or distributed.engine=deepspeed for nvme.",
            )
        )
    if engine in ("single", "ddp", "fsdp") and d.offload_optimizer != "none":
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                f"optimizer offload needs DeepSpeed, engine is {engine}",
                "Set distributed.engine=deepspeed, or offload_optimizer=none (FSDP: use offload_params=cpu).",
            )
        )
    if (r.optim.name.startswith("paged") or r.optim.name.endswith("8bit")) and engine == "deepspeed":
        if d.offload_optimizer != "none":
            p.append(
                Problem(
                    where("optim.name"),
                    "bitsandbytes optimizers cannot be offloaded by DeepSpeed",
                    "Use optim.name=adamw with offload, or offload_optimizer=none.",
                )
            )
    if engine == "deepspeed" and d.offload_optimizer != "none" and d.zero_stage == 0:
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                "ZeRO stage 0 has no optimizer partitions to offload (DeepSpeed would silently keep them on the GPU)",
                "Set distributed.zero_stage to 1, 2 or 3, or offload_optimizer=none.",
            )
        )
    if engine == "deepspeed" and d.offload_optimizer == "nvme" and d.zero_stage in (1, 2):
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                f"nvme optimizer offload needs ZeRO stage 3 (stage {d.zero_stage} would silently offload to CPU RAM)",
                "Set distributed.zero_stage=3, or offload_optimizer=cpu.",
            )
        )
    return p


def _quantization_problems(r: Recipe, engine: str, dp_size: int, where: Callable[[str], str]) -> list[Problem]:
    p: list[Problem] = []
    d, m = r.distributed, r.model
    # FSDP2 turns every param into a DTensor even on one rank, which drops the int8 weights' scales.
    if (
        m.quantization is not None
        and m.quantization.bits == 8
        and (engine == "fsdp" or (engine == "deepspeed" and dp_size > 1))
    ):
        p.append(
            Problem(
                where("model.quantization.bits"),
                f"8-bit weights cannot be sharded by {engine}",
                "Use bits: 4 (its storage dtype can be sharded) or distributed.engine=ddp.",
            )
        )
    q = m.quantization
    if q is not None and shards_params(engine, d.zero_stage) and q.quant_storage not in (None, m.dtype):
        name = "FSDP2" if engine == "fsdp" else "ZeRO-3"
        p.append(
            Problem(
                where("model.quantization.quant_storage"),
                f"{q.quant_storage} differs from model.dtype {m.dtype}: {name} shards 4-bit weights only when they "
                "are stored in the dtype of the other parameters",
                f"Set model.quantization.quant_storage={m.dtype} or null (null picks it automatically).",
            )
        )
    return p


def plan_summary(plan: RunPlan) -> dict[str, Any]:
    """The decisions as plain data (``plan.yaml`` of a compiled dir, trackers)."""
    return {
        "engine": plan.engine,
        **({"zero_stage": plan.zero_stage} if plan.engine == "deepspeed" else {}),
        "world": {"nnodes": plan.world.nnodes, "nproc_per_node": plan.world.nproc_per_node},
        "batch": {**plan.batch.to_dict(), "equation": plan.batch.equation()},
        "dtype": plan.dtype,
        "quant_storage": plan.quant_storage,
        "model_init": "meta" if plan.meta_init else "zero_init" if plan.zero_init else "whole",
        "chunked_loss": plan.chunked_loss,
        "notes": list(plan.notes),
    }


def describe_engine(plan: RunPlan) -> str:
    """``fsdp``, ``deepspeed (ZeRO-3)``: for banners and reports."""
    return f"{plan.engine} (ZeRO-{plan.zero_stage})" if plan.engine == "deepspeed" else plan.engine
