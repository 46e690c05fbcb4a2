"""What a resolved run is: ``World`` (the processes), ``ParallelLayout`` (how they divide the work,
as named dimensions) and ``RunPlan`` (every decision). ``llmft.plan.resolve`` makes them; every
other module reads them. Pure: no torch, and nothing here imports the planners (``memory``,
``deepspeed``), which read a ``RunPlan`` themselves.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from llmft.plan.batch import BatchPlan
from llmft.plan.engines import EngineSpec, engine_spec, one_process_engine
from llmft.plan.objectives import DEFAULT_OBJECTIVE, ObjectiveSpec, objective_spec
from llmft.recipe.load import unresolve_env
from llmft.recipe.schema import Recipe


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


def data_parallel_size(world_size: int, sp: int) -> int:
    """Data-parallel ranks of ``world_size`` processes in sequence groups of ``sp``: each group is
    one (the one place this is computed; ``ParallelLayout.dp_size`` is its result)."""
    return max(world_size // sp, 1)


@dataclass(frozen=True)
class ParallelLayout:
    """How the run's processes divide the work; the runtime reads it instead of asking the engine.

    A parallel dimension is a field here, sized by the resolver, not a check of the engine's name
    wherever it matters. Ranks ``[g*sp, (g+1)*sp)`` form sequence group ``g`` (its data-parallel
    rank): they share each sequence, each holding a slice of its tokens."""

    dp_size: int  # data-parallel ranks (sequence groups): each sees its own part of the batch
    shards_params: bool  # parameters are partitioned over the ranks (FSDP2, ZeRO-3): every rank joins every forward
    dp_replicate: int = 1  # HSDP: replica groups; parameters are sharded within a group of world / dp_replicate
    sp: int = 1  # distributed.sequence_parallel: ranks that share one sequence

    @property
    def dp_shard(self) -> int:
        """Ranks that share one copy of the (sharded) parameters. With sequence parallelism the
        parameters are sharded over every rank of a replica, sequence ranks included: they all
        compute gradients of the same parameters (docs/long-context.md)."""
        return self.world_size // self.dp_replicate if self.shards_params else 1

    @property
    def world_size(self) -> int:
        """Processes in the layout: data-parallel ranks x sequence-parallel ranks."""
        return self.dp_size * self.sp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank (sequence group) of global ``rank``: the sampler's rank."""
        return rank // self.sp

    def sp_rank(self, rank: int) -> int:
        """Which slice of its group's sequences global ``rank`` holds."""
        return rank % self.sp

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """The run's processes as named dimensions, outermost first (torchtitan's ``ParallelDims``):
        ``replicate`` (HSDP replica groups), ``shard`` (the data-parallel ranks of a replica: they
        share one copy of sharded parameters, or hold plain replicas), ``sp`` (the ranks of a
        sequence group, innermost: consecutive ranks, ``dp_rank`` / ``sp_rank``). Their product is
        the world; ``param_mesh`` is the mesh FSDP2 shards parameters on."""
        replicate = self.dp_replicate if self.shards_params else 1
        return (("replicate", replicate), ("shard", self.dp_size // replicate), ("sp", self.sp))

    @property
    def param_mesh(self) -> tuple[tuple[str, int], ...]:
        """The mesh parameters are sharded on (FSDP2), named: ``replicate`` (HSDP replica groups; left
        out when 1) x ``shard`` (``dp_shard``: ``mesh``'s ``shard`` and ``sp`` together, as sequence
        ranks compute gradients of the same parameters). ``llmft.job.dist.device_mesh`` builds it."""
        shard = (("shard", self.dp_shard),)
        return (("replicate", self.dp_replicate), *shard) if self.dp_replicate > 1 else shard


@dataclass(frozen=True)
class RunPlan:
    """The resolved run. ``recipe`` is the intent as the user wrote it; the rest are decisions."""

    recipe: Recipe
    world: World
    engine: str  # a name of llmft.plan.engines.ENGINES (``spec`` is its record)
    batch: BatchPlan
    layout: ParallelLayout
    # Packed 4-bit weights: stored as this dtype. Engines that shard parameters (FSDP2, ZeRO-3)
    # partition tensors of one dtype, so there they are viewed as the compute dtype; elsewhere uint8.
    quant_storage: str | None
    # A fresh model small enough to be built whole on every rank with the seeded init (then
    # sharded): its weights equal the single-process run's on every engine and world size.
    builds_whole: bool
    notes: tuple[str, ...] = ()  # what resolving changed, for the log
    objective: str = DEFAULT_OBJECTIVE  # a registered objective's name (``objective_spec`` is its record)
    # Where a preference run's reference log-probs come from (llmft.plan.objectives: none,
    # adapters_disabled, frozen_copy, model); the engines build what it says.
    reference: str = "none"
    # The LM head and loss run in chunks of tokens (``llmft.model.loss``; ``memory.chunked_loss_on``).
    chunked_loss: bool = False

    @property
    def spec(self) -> EngineSpec:
        return engine_spec(self.engine)

    @property
    def objective_spec(self) -> ObjectiveSpec:
        return objective_spec(self.objective)

    @property
    def dp_size(self) -> int:
        return self.batch.dp_size

    @property
    def sequence_parallel(self) -> int:
        """Ranks that share each sequence (``distributed.sequence_parallel``)."""
        return self.layout.sp

    @property
    def max_grad_norm(self) -> float | None:
        """Gradient clipping, the one source every engine is built with (DeepSpeed's config included)."""
        return self.recipe.optim.max_grad_norm

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
        (a pretrained model, a 4-bit one included: ``model/zero3.py``)."""
        if self.builds_whole:
            return False
        q = self.recipe.model.quantization
        pretrained = self.recipe.model.config is None
        if not self.layout.shards_params:
            return False
        if self.spec.zero_init:  # a fresh model too big to build whole is built under zero.Init instead
            return pretrained and (q is None or q.bits == 4)
        return q is None or (q.bits == 4 and pretrained)

    @property
    def zero_init(self) -> bool:
        """ZeRO-3 builds the model partitioned under ``zero.Init``: a fresh model too big to build
        whole (a quantized one is still built whole: transformers does not enter ``zero.Init`` then)."""
        return self.spec.zero_init and self.layout.shards_params and not self.builds_whole and not self.meta_init

    def on_one_process(self) -> RunPlan:
        """The same run built as one process would build it (``llmft verify`` emulates the ranks)."""
        one = one_process_engine()
        return replace(
            self,
            engine=one.name,
            layout=parallel_layout(self.recipe, one, self.dp_size),
            quant_storage=quant_storage_for(self.recipe, one),
        )

    def frozen_model_plan(self, name_or_path: str) -> RunPlan:
        """The plan a frozen model named ``name_or_path`` (a reference or reward model) is built from:
        this run's, with that model instead of the policy's and no adapters."""
        recipe = copy.deepcopy(self.recipe)
        recipe.model.name_or_path, recipe.model.config, recipe.model.revision = name_or_path, None, None
        recipe.peft.method = "none"
        return replace(self, recipe=recipe, builds_whole=False)

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


def parallel_layout(recipe: Recipe, spec: EngineSpec, dp_size: int) -> ParallelLayout:
    """How ``spec`` lays the run out over ``dp_size`` data-parallel ranks (each a group of
    ``distributed.sequence_parallel`` ranks where the engine runs sequence parallelism)."""
    shards = spec.shards_parameters(recipe)
    return ParallelLayout(
        dp_size=dp_size,
        shards_params=shards,
        dp_replicate=recipe.distributed.hsdp_replicate if shards else 1,
        sp=recipe.distributed.sequence_parallel if spec.sequence_parallel else 1,
    )


def quant_storage_for(recipe: Recipe, spec: EngineSpec) -> str | None:
    """How packed 4-bit weights are stored on ``engine`` (None: not 4-bit). Where parameters are
    sharded (FSDP2, ZeRO-3) the packed bytes are viewed as the compute dtype, as HF/PEFT, Axolotl
    and LLaMA-Factory do with ``bnb_4bit_quant_storage``; elsewhere plain uint8."""
    q = recipe.model.quantization
    if q is None or q.bits != 4:
        return None
    if q.quant_storage is not None:
        return q.quant_storage
    return recipe.model.dtype if spec.shards_parameters(recipe) else "uint8"
