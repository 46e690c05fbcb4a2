"""What a resolved run is: ``World`` (the processes), ``ParallelLayout`` (how they divide the work,
as named dimensions) and ``RunPlan`` (every decision). ``llmft.plan.resolve`` makes them; every
other module reads them. Pure: no torch, and nothing here imports the planners (``memory``,
``deepspeed``), which read a ``RunPlan`` themselves.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Callable

from llmft.errors import Problem
from llmft.plan.batch import BatchPlan, divisors
from llmft.plan.dims import DIMENSIONS, REPLICATE, Dimension, splits, title
from llmft.plan.engines import EngineSpec, engine_spec, load, one_process_engine
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


@dataclass(frozen=True)
class ParallelLayout:
    """How the run's processes divide the work: the size of every parallel dimension
    (``llmft.plan.dims``), decided once by the resolver. The runtime, the batch equation and the
    memory planner read it instead of the recipe or the engine's name.

    Ranks are row-major over ``mesh``, the data dimensions outermost and the split ones innermost:
    ranks ``[g*S, (g+1)*S)`` (S the product of the split dimensions, ``sp`` alone today) share the
    sequences of data-parallel rank ``g``, each holding a slice of their tokens."""

    dims: tuple[tuple[Dimension, int], ...]  # every registered dimension and its size, in registry order
    shards_params: bool  # parameters are partitioned over the ranks (FSDP2, ZeRO-3): every rank joins every forward

    def size(self, name: str) -> int:
        return next((n for d, n in self.dims if d.name == name), 1)

    def _product(self, role: str) -> int:
        return math.prod(n for d, n in self.dims if d.role == role)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (``replicate`` x ``shard``): each sees its own part of the batch."""
        return self._product("data")

    @property
    def world_size(self) -> int:
        """Processes in the layout: data-parallel ranks x the split dimensions."""
        return self.dp_size * self._product("split")

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks of ``world_size`` processes with these split dimensions (a compiled
        plan's world, re-solved for the launched one)."""
        return max(world_size // self._product("split"), 1)

    @property
    def dp_replicate(self) -> int:
        """HSDP replica groups; parameters are sharded within a group of world / dp_replicate."""
        return self.size("replicate")

    @property
    def sp(self) -> int:
        """``distributed.sequence_parallel``: ranks that share one sequence."""
        return self.size("sp")

    @property
    def splits(self) -> tuple[tuple[str, int], ...]:
        """The split dimensions over 1, as the batch plan names them: ``(("sequence_parallel", 2),)``."""
        return tuple((d.plan_key, n) for d, n in self.dims if d.role == "split" and n > 1)

    @property
    def borrowed(self) -> tuple[tuple[str, int], ...]:
        """The borrowed dimensions over 1, as files name them: ``(("expert_parallel", 2),)``."""
        return tuple((d.plan_key, n) for d, n in self.dims if d.role == "borrow" and n > 1)

    @property
    def shard_group(self) -> int:
        """Ranks that hold the same parameters within a replica, whether or not the engine shards
        them: the dimensions with ``params="sharded"`` (``shard``, its borrowers, ``sp``: sequence
        ranks compute gradients of the same parameters, docs/long-context.md)."""
        return math.prod(n for d, n in self.dims if d.params == "sharded" and d.role != "borrow")

    @property
    def dp_shard(self) -> int:
        """Ranks that share one copy of the (sharded) parameters; 1 where the engine does not shard them."""
        return self.shard_group if self.shards_params else 1

    def _mesh_dims(self) -> list[tuple[Dimension, int]]:
        """``mesh`` with the records: each data dimension followed by those borrowed from it (which
        take its innermost ranks), then the split dimensions."""
        out = []
        for d, n in self.dims:
            if d.role == "data":
                # a borrowed dimension of size 1 is no dimension: the mesh (and its views) leave it out
                borrowed = [(b, k) for b, k in self.dims if b.role == "borrow" and b.of == d.name and k > 1]
                out += [(d, n // math.prod(k for _, k in borrowed)), *borrowed]
        return out + [(d, n) for d, n in self.dims if d.role == "split"]

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """The run's processes as named dimensions, outermost first (torchtitan's ``ParallelDims``):
        ``replicate`` (HSDP replica groups), ``shard`` (the data-parallel ranks of a replica: they
        share one copy of sharded parameters, or hold plain replicas), ``sp`` (the ranks of a
        sequence group, innermost: consecutive ranks, ``dp_rank`` / ``sp_rank``). Their product is
        the world; ``llmft.job.dist.run_mesh`` builds it as a view of the world mesh."""
        return tuple((d.name, n) for d, n in self._mesh_dims())

    def coordinate(self, rank: int, name: str) -> int:
        """Global ``rank``'s index along dimension ``name`` (0 where the layout has no such dimension)."""
        inner = 1
        for dim, n in reversed(self.mesh):
            if dim == name:
                return rank // inner % n
            inner *= n
        return 0

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank (sequence group) of global ``rank``: the sampler's rank."""
        return rank // self._product("split")

    def sp_rank(self, rank: int) -> int:
        """Which slice of its group's sequences global ``rank`` holds."""
        return self.coordinate(rank, "sp")

    @property
    def param_view(self) -> tuple[tuple[str, int], ...]:
        """The world as FSDP2 sees it, outermost first: ``replicate``, then ``shard`` (the dimensions
        whose ranks share parameters, neighbours in ``mesh``, merged: ``shard`` and ``sp``), then
        each dimension that owns its parameters. ``param_mesh`` names the part FSDP2 shards on;
        ``llmft.job.dist.param_mesh`` builds it as a view of the world mesh."""
        records = {d.name: d for d, _ in self.dims}
        out: list[tuple[str, int]] = []
        for d, n in self._mesh_dims():
            params = records[d.of].params if d.role == "borrow" else d.params
            name = {"replicated": "replicate", "sharded": "shard"}.get(params, d.name)
            if out and out[-1][0] == name:
                out[-1] = (name, out[-1][1] * n)
            else:
                out.append((name, n))
        assert len({name for name, _ in out}) == len(out), f"the sharded dimensions are not neighbours: {out}"
        return tuple(out)

    @property
    def param_mesh(self) -> tuple[tuple[str, int], ...]:
        """The mesh parameters are sharded on (FSDP2), named: ``replicate`` (HSDP replica groups; left
        out when 1) x ``shard`` (``dp_shard``: ``mesh``'s ``shard`` and ``sp`` together, as sequence
        ranks compute gradients of the same parameters)."""
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

    def equation(self) -> str:
        """The batch equation and the dimensions borrowed from data parallelism, which leave it as it
        is: ``micro 1 x accumulation 2 x data-parallel 2 = global 4 (expert-parallel 2 within data-parallel 2)``."""
        borrowed = self.layout.borrowed
        if not borrowed:
            return self.batch.equation()
        within = ", ".join(f"{title(key)} {n}" for key, n in borrowed)
        return f"{self.batch.equation()} ({within} within data-parallel {self.dp_size})"

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
            layout=layout_of(self.recipe, one, self.dp_size),
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


def parallel_layout(
    recipe: Recipe, spec: EngineSpec, world_size: int, where: Callable[[str], str] = str
) -> tuple[ParallelLayout, list[Problem]]:
    """Every registered dimension sized once for ``recipe`` on engine ``spec`` over ``world_size``
    processes (the resolver's), and what is wrong with them: each dimension's own checks
    (``Dimension.problems``), then the combinations that cannot be laid out (split dimensions whose
    product does not divide the world, replica groups that do not divide the data-parallel ranks the
    split dimensions leave, a borrowed dimension that does not divide its host), each naming the keys
    involved. A dimension with a problem is sized 1: the batch is solved, and reported, without it."""
    problems: list[Problem] = []
    sizes = {}
    for d in DIMENSIONS:
        own = load(d.problems)(recipe, spec, world_size, where) if d.problems else []
        problems += own
        sizes[d.name] = 1 if own or d.key is None else d.sized(recipe, spec)
    said: list[str] = []  # the split dimensions over 1 so far, as "key n"
    per_rank = 1  # ranks that share one data-parallel rank's sequences
    for d in splits():
        n = sizes[d.name]
        if world_size % (per_rank * n) == 0:
            per_rank *= n
            said += [f"{d.key} {n}"] if n > 1 else []
            continue
        valid = f"one of {_either(divisors(world_size // per_rank))}"
        what, fix = f"{n} does not divide the world size {world_size}", f"Choose {valid}."
        if said:
            ranks = f"{n} x {' x '.join(said)} = {per_rank * n} ranks per data-parallel rank"
            what = f"{ranks} do not divide the world size {world_size}"
            fix = f"Choose {valid} with {' and '.join(said)}, or make those smaller."
        problems.append(Problem(where(d.key), what, fix))
        sizes[d.name] = 1
    dp = max(world_size // per_rank, 1)
    replicate = sizes["replicate"]
    if dp % replicate:
        if world_size % replicate == 0:  # one that does not divide the world: resolve's engine checks say so
            problems.append(
                Problem(
                    where(REPLICATE.key),
                    f"{replicate} does not divide the data-parallel size {dp} "
                    f"(world {world_size} / {' x '.join(said)})",
                    f"Choose a divisor of {dp}, or fewer ranks per data-parallel rank.",
                )
            )
        sizes["replicate"] = 1
    sizes["shard"] = dp // sizes["replicate"]
    for d in DIMENSIONS:
        if d.role == "borrow" and sizes[d.of] % sizes[d.name]:
            problems.append(
                Problem(
                    where(d.key),
                    f"{sizes[d.name]} does not divide the {sizes[d.of]} ranks of the {d.of} dimension "
                    "it is carved from",
                    f"Choose one of {_either(divisors(sizes[d.of]))}.",
                )
            )
            sizes[d.name] = 1
    return _layout(sizes, spec.shards_parameters(recipe)), problems


def _either(values: list[int]) -> str:
    """``1, 2 or 4``."""
    words = [str(v) for v in values]
    return " or ".join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else words[0]


def layout_of(recipe: Recipe, spec: EngineSpec, dp_size: int) -> ParallelLayout:
    """``dp_size`` data-parallel ranks, every other dimension as ``recipe`` asks on ``spec``,
    unchecked: the layout of a recipe that has no resolved plan (the memory planner asked by a
    library caller or a benchmark; a run emulated on one process)."""
    sizes = {d.name: d.sized(recipe, spec) for d in DIMENSIONS if d.key is not None}
    sizes["shard"] = max(dp_size // sizes["replicate"], 1)
    return _layout(sizes, spec.shards_parameters(recipe))


def _layout(sizes: dict[str, int], shards_params: bool) -> ParallelLayout:
    return ParallelLayout(dims=tuple((d, sizes[d.name]) for d in DIMENSIONS), shards_params=shards_params)


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
