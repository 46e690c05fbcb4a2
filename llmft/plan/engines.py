"""The engine registry: one record per engine, found by one lookup (``engine_spec(name)``).

A record says what an engine is (its name and title), what it does with a run's state (which
states it partitions over the data-parallel ranks, where it can offload them, how it keeps its
weights), which recipe settings it honours, what it writes at compile time and which code runs
it. Everything that used to branch on an engine's name (the resolver's checks, the memory
planner, the compiler, export, eval) reads these fields instead, so adding an engine is adding a
record here, its runtime class under ``llmft/engines/`` and, if it has one, its config writer
under ``llmft/plan/``.

Code is named by dotted path (``"module:attribute"``) and imported only when it is used
(``load``): the runtime parts (the engine class, the checkpoint readers) import torch, and this
module, like the rest of ``llmft.plan``, must not, so ``llmft compile`` and ``llmft plan`` run
without it. The engine-specific recipe checks and config writers are pure and named the same way
to keep the registry free of import cycles with the compiler.

The policy of ``distributed.engine: auto`` (``choose_engine``) lives here too: it is the one
other place that names engines.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe

AUTO = "auto"


@dataclass(frozen=True)
class Sharding:
    """Which training states an engine partitions over the data-parallel ranks."""

    params: bool = False
    gradients: bool = False
    optimizer: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """One engine: what it is, what it can do, and where its code lives (dotted paths)."""

    name: str  # distributed.engine
    title: str  # in messages: "FSDP2", "DeepSpeed"
    runtime: str  # the Engine class (torch side): built by llmft.engines.build_engine
    reader: str  # (model, step_dir) -> None: a checkpoint's weights into a whole model, one process
    checkpoint_files: str  # (step_dir) -> [Path]: the files a resume opens, checked present before one starts
    # Runs in a process group (on any number of ranks); False: one process, no group.
    multi_rank: bool = True
    # What it partitions; an engine with ZeRO stages partitions what its stage says instead.
    sharding: Sharding = Sharding()
    zero_stages: tuple[int, ...] = ()
    sharded_title: str = ""  # the name of its parameter sharding, in messages: "FSDP2", "ZeRO-3"
    param_offload: tuple[str, ...] = ()  # devices it can offload parameters to
    optimizer_offload: tuple[str, ...] = ()  # devices it can offload optimizer state to
    offload_moves_all: bool = False  # offloading parameters moves their gradients and optimizer state too
    settings: tuple[str, ...] = ()  # engine-specific recipe keys it honours (the other engines ignore them)
    int8_max_ranks: int | None = None  # LLM.int8 weights survive on at most this many ranks (None: any)
    # Trainable weights stay in the compute dtype beside an fp32 master copy (else fp32 weights).
    low_precision_weights: bool = False
    gradient_copies: int = 1  # gradients held twice (DDP's flat buckets)
    autocast_weight_cache: bool = False  # autocast keeps compute-dtype copies of fp32 weights
    # How sharded parameters are gathered for compute: "per_layer" (a layer and the next, and the
    # root) or "live_window" (up to ZERO3_MAX_LIVE_PARAMETERS stay gathered between passes).
    param_gather: Literal["per_layer", "live_window"] | None = None
    # Its own hooks run around every submodule (ZeRO-3 gathers parameters in them): llmft does not
    # torch.compile layers underneath it (``model.compile``).
    module_hooks: bool = False
    # Sharded parameters exist whole only inside their own module's call, so code that reads a
    # weight directly (Liger's fused cross-entropy reads lm_head.weight) sees an empty one.
    gathers_in_module_call: bool = False
    # A fresh model too big to build whole is built partitioned under zero.Init (else on the meta device).
    zero_init: bool = False
    whole_param_on_load: bool = False  # loading sharded puts one whole parameter on the device for a moment
    # The model exists only as the engine's own (sharded) state, not a save_pretrained dir:
    # export streams it with ``stream_reader`` ((step_dir) -> {name: empty} -> filled).
    sharded_checkpoint: bool = False
    stream_reader: str | None = None
    config_files: str | None = None  # (plan, header lines) -> {file: text} written by llmft compile
    config_names: tuple[str, ...] = ()  # the files config_files writes
    summary: str | None = None  # (plan) -> str: the compile summary's engine line
    problems: str | None = None  # (recipe, where) -> [Problem]: what this engine alone refuses
    # (step_dir, out) -> Path: converts its checkpoint to a form any world size loads, offline
    # (``python -m llmft.checkpoint universal``); None: its checkpoints load on any world size as written.
    universal: str | None = None
    launcher: str = "torchrun"  # launch/<launcher>.sh starts it
    # Runs ``distributed.sequence_parallel`` > 1 (Ulysses attention, sequence slices, gradients
    # summed over the whole world: docs/long-context.md).
    sequence_parallel: bool = False
    # Runs ``distributed.expert_parallel`` > 1 (whole experts on ranks, tokens all-to-all:
    # ``llmft.model.expert_parallel``).
    expert_parallel: bool = False
    # Packs a mixture of experts' fused expert weights of a 4-bit (QLoRA) base in 4 bits too
    # (``llmft.model.moe_quant``: built whole in each process, or partitioned by FSDP2 or ZeRO-3 with
    # each rank quantizing its part of a pretrained model's).
    packs_experts: bool = False
    # How ``model.tiled_mlp`` tiles (docs/long-context.md): DeepSpeed's ``TiledMLP`` back-propagates
    # tile by tile and a parameter's gradient arrives once per tile (DeepSpeed holds it until the
    # last one); "checkpoint" runs one non-reentrant checkpoint per tile, so autograd sums the tiles
    # before a parameter's gradient is ready once, which is when DDP's and FSDP2's hooks reduce it.
    tiled_mlp: Literal["TiledMLP", "checkpoint"] = "TiledMLP"

    def sharding_for(self, zero_stage: int) -> Sharding:
        """What this engine partitions at ``distributed.zero_stage`` (ignored without ZeRO stages)."""
        if not self.zero_stages:
            return self.sharding
        return Sharding(params=zero_stage >= 3, gradients=zero_stage >= 2, optimizer=zero_stage >= 1)

    def shards_parameters(self, recipe: Recipe) -> bool:
        """It partitions the parameters themselves (FSDP2, ZeRO-3), not only their state."""
        return self.sharding_for(recipe.distributed.zero_stage).params

    def describe(self, zero_stage: int) -> str:
        """``fsdp``, ``deepspeed (ZeRO-3)``: for banners and reports."""
        return f"{self.name} (ZeRO-{zero_stage})" if self.zero_stages else self.name

    def honours(self, key: str) -> bool:
        return key in self.settings


ENGINES: tuple[EngineSpec, ...] = (
    EngineSpec(
        name="single",
        title="single",
        runtime="llmft.engines.single:SingleEngine",
        reader="llmft.engines.base:read_plain",
        checkpoint_files="llmft.checkpoint.verify:plain_files",
        packs_experts=True,
        multi_rank=False,
        autocast_weight_cache=True,
    ),
    EngineSpec(
        name="ddp",
        title="DDP",
        runtime="llmft.engines.ddp:DDPEngine",
        reader="llmft.engines.base:read_plain",
        checkpoint_files="llmft.checkpoint.verify:plain_files",
        packs_experts=True,
        gradient_copies=2,  # gradient_as_bucket_view is off
        autocast_weight_cache=True,
        sequence_parallel=True,
        tiled_mlp="checkpoint",
    ),
    EngineSpec(
        name="fsdp",
        title="FSDP2",
        runtime="llmft.engines.fsdp:FSDPEngine",
        reader="llmft.engines.fsdp:read_dcp",
        checkpoint_files="llmft.checkpoint.verify:dcp_files",
        sharding=Sharding(params=True, gradients=True, optimizer=True),
        sharded_title="FSDP2",
        param_offload=("cpu",),
        offload_moves_all=True,  # CPUOffloadPolicy: the optimizer step runs on the CPU
        settings=("distributed.fsdp_grad_sync", "distributed.hsdp_replicate"),
        int8_max_ranks=0,  # every parameter becomes a DTensor, even on one rank: the int8 scales are lost
        param_gather="per_layer",
        sharded_checkpoint=True,
        stream_reader="llmft.engines.fsdp:dcp_reader",
        config_files="llmft.plan.fsdp:config_files",
        config_names=("fsdp.yaml", "accelerate.yaml"),
        summary="llmft.plan.fsdp:summary",
        sequence_parallel=True,
        expert_parallel=True,
        packs_experts=True,
        tiled_mlp="checkpoint",
    ),
    EngineSpec(
        name="deepspeed",
        title="DeepSpeed",
        runtime="llmft.engines.deepspeed:DeepSpeedEngineAdapter",
        reader="llmft.engines.deepspeed:read_deepspeed",
        checkpoint_files="llmft.checkpoint.verify:deepspeed_files",
        zero_stages=(0, 1, 2, 3),
        sharded_title="ZeRO-3",
        param_offload=("cpu", "nvme"),
        optimizer_offload=("cpu", "nvme"),
        int8_max_ranks=1,
        low_precision_weights=True,
        param_gather="live_window",
        module_hooks=True,
        gathers_in_module_call=True,
        zero_init=True,
        whole_param_on_load=True,
        sharded_checkpoint=True,
        stream_reader="llmft.engines.deepspeed:deepspeed_reader",
        config_files="llmft.plan.deepspeed:config_files",
        config_names=("ds_config.json",),
        summary="llmft.plan.deepspeed:summary",
        problems="llmft.plan.deepspeed:engine_problems",
        universal="llmft.engines.deepspeed:deepspeed_universal",
        launcher="deepspeed",
        sequence_parallel=True,
        packs_experts=True,
    ),
)

_BY_NAME = {spec.name: spec for spec in ENGINES}
ENGINE_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def engine_spec(name: str) -> EngineSpec:
    """The record of a resolved engine name (``auto`` is resolved before: ``choose_engine``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise AssertionError(f"unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}") from None


def tiled_mlp_kind(name: str) -> str:
    """How ``model.tiled_mlp`` tiles under engine ``name`` (``EngineSpec.tiled_mlp``); an unresolved
    ``auto`` (a model built outside a run: export, tools) never back-propagates, so either does."""
    return engine_spec(name).tiled_mlp if name != AUTO else EngineSpec.tiled_mlp


def one_process_engine() -> EngineSpec:
    """The engine a run on one process without a process group uses (``llmft verify`` emulates ranks on it)."""
    (spec,) = (s for s in ENGINES if not s.multi_rank)
    return spec


def universal_converter() -> str:
    """The dotted path of the one offline checkpoint converter (DeepSpeed's universal format):
    ``python -m llmft.checkpoint universal`` runs it without importing the engines."""
    (spec,) = (s for s in ENGINES if s.universal)
    return spec.universal


def choose_engine(recipe: Recipe, dp_size: int) -> str:
    """``auto``: one process -> single; several -> deepspeed when offloading the optimizer or to nvme,
    fsdp for a full fine-tune (the replicas would not fit), ddp for adapters (small gradients)."""
    d = recipe.distributed
    if d.engine != AUTO:
        return d.engine
    if dp_size == 1:
        return one_process_engine().name
    if d.offload_optimizer != "none" or d.offload_params == "nvme":
        return "deepspeed"
    if recipe.peft.method == "none" or d.offload_params == "cpu":
        return "fsdp"
    return "ddp"


def load(path: str) -> Any:
    """The object a record names as ``"module:attribute"``, imported now."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
