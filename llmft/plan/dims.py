"""The parallel dimensions a run's processes are laid out over: one record each, as ``plan/engines.py``
holds one per engine (torchtitan's ``ParallelDims`` is the model).

``replicate`` and ``shard`` are data parallelism (HSDP's replica groups, and the ranks of one
replica: each rank sees its own sequences); ``sp`` splits every sequence over consecutive ranks
(Ulysses, docs/long-context.md). The resolver sizes every registered record once, from the recipe
and the launched world (``llmft.plan.layout.parallel_layout``); the batch equation, the memory
planner, the sampler's rank and the world mesh (``llmft.job.dist``) read those sizes from the
layout, never from the recipe.

A new dimension is one record here and its own code: tensor parallelism a ``split`` record like
``sp`` whose ranks hold parameters of their own; expert parallelism (``ep``) is a ``borrow`` record
carved out of ``shard`` (torchtitan's ``dp_shard_in_ep``: the world, the data-parallel size and the
global batch stay as they are). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from llmft.plan.engines import load

if TYPE_CHECKING:
    from llmft.plan.engines import EngineSpec
    from llmft.recipe.schema import Recipe

Role = Literal["data", "split", "borrow"]
Params = Literal["sharded", "replicated", "own"]


@dataclass(frozen=True)
class Dimension:
    """One parallel dimension."""

    name: str  # its name in the world mesh and in ``ParallelLayout``: replicate, shard, sp
    # data: its ranks see different sequences; the data-parallel size is the product of these.
    # split: its ranks share the sequences of one data-parallel rank and split the work on them;
    #   world = data-parallel size x the product of these. Innermost in the mesh, in registration order.
    # borrow: the inner ranks of the data dimension ``of``, whose size it divides (expert parallelism):
    #   neither the world, nor the data-parallel size, nor the global batch changes.
    role: Role
    key: str | None = None  # the recipe key that sizes it; None: the world does (the ranks left over)
    # "module:function" (recipe, engine spec) -> int: its size for that engine (1: off); None: the key's value.
    size: str | None = None
    # How a sharding engine holds the parameters over its ranks: "sharded" (they compute gradients of
    # the same parameters, so FSDP2 and ZeRO shard over them: shard, sp), "replicated" (HSDP's replica
    # groups), "own" (its own code partitions them, as tensor parallelism would: not in FSDP2's mesh).
    # A borrowed dimension lies inside its host and takes the host's.
    params: Params = "sharded"
    of: str | None = None  # borrow: the data dimension it is carved out of
    # "module:function" (recipe, engine spec, world size, where) -> [Problem]: its own checks,
    # reported with the recipe's; a dimension with any is sized 1 to solve the batch.
    problems: str | None = None

    def asked(self, recipe: Recipe) -> int:
        """Its recipe key's value: 1 where no key sizes it or the recipe has no such key."""
        if self.key is None:
            return 1
        section, name = self.key.split(".")
        return int(getattr(getattr(recipe, section, None), name, 1) or 1)

    def sized(self, recipe: Recipe, spec: EngineSpec) -> int:
        """Its size for ``recipe`` on engine ``spec``."""
        return int(load(self.size)(recipe, spec)) if self.size else self.asked(recipe)

    @property
    def plan_key(self) -> str:
        """How files name it (``plan.yaml``'s batch, ``trainer_state.json``): its key's last part."""
        return (self.key or self.name).rsplit(".", 1)[-1]


def title(plan_key: str) -> str:
    """How the batch equation names a dimension: ``sequence-parallel``."""
    return plan_key.replace("_", "-")


def replicas(recipe: Recipe, spec: EngineSpec) -> int:
    """HSDP replica groups: ``distributed.hsdp_replicate`` where the engine shards parameters."""
    return REPLICATE.asked(recipe) if spec.shards_parameters(recipe) else 1


def sequence_ranks(recipe: Recipe, spec: EngineSpec) -> int:
    """Ranks sharing each sequence: ``distributed.sequence_parallel`` where the engine runs it."""
    return SEQUENCE.asked(recipe) if spec.sequence_parallel else 1


REPLICATE = Dimension(
    "replicate", "data", key="distributed.hsdp_replicate", size="llmft.plan.dims:replicas", params="replicated"
)
SHARD = Dimension("shard", "data")
SEQUENCE = Dimension(
    "sp",
    "split",
    key="distributed.sequence_parallel",
    size="llmft.plan.dims:sequence_ranks",
    problems="llmft.plan.resolve:sequence_parallel_problems",
)


def expert_ranks(recipe: Recipe, spec: EngineSpec) -> int:
    """Ranks that split the routed experts: ``distributed.expert_parallel`` on FSDP2 (the other
    engines refuse it: ``llmft.plan.moe_recipe.expert_parallel_problems``)."""
    return EXPERT.asked(recipe) if spec.expert_parallel else 1


# Expert parallelism: the innermost ranks of ``shard`` (torchtitan's ``dp_shard_in_ep``), each holding
# E / N whole experts of every MoE layer (``llmft.model.expert_parallel``).
EXPERT = Dimension(
    "ep",
    "borrow",
    key="distributed.expert_parallel",
    size="llmft.plan.dims:expert_ranks",
    of="shard",
    problems="llmft.plan.moe_recipe:expert_parallel_problems",
)

# Every dimension, in mesh order within a role: the data ones outermost, then the split ones.
DIMENSIONS: list[Dimension] = [REPLICATE, SHARD, EXPERT, SEQUENCE]


def register_dimension(dim: Dimension) -> Dimension:
    """Add ``dim`` (a module that defines a dimension calls this when it is imported). The same
    record again is a no-op; data parallelism is ``replicate`` x ``shard`` only."""
    known = {d.name: d for d in DIMENSIONS}
    if known.get(dim.name) == dim:
        return dim
    if dim.name in known:
        raise ValueError(f"a parallel dimension named {dim.name!r} is registered already: {known[dim.name]}")
    if dim.role == "data":
        raise ValueError(f"{dim.name!r}: data parallelism is replicate x shard; register a split or borrow dimension")
    if dim.key is None:
        raise ValueError(f"{dim.name!r} names no recipe key: its size and its problems are reported under one")
    if dim.role == "borrow" and (dim.of not in known or known[dim.of].role != "data"):
        raise ValueError(f"{dim.name!r} borrows from {dim.of!r}, which is not a data dimension")
    if dim.role == "split" and dim.params == "sharded" and any(d.params == "own" for d in splits()):
        # FSDP2's shard dimension spans the sharded ones: they must be neighbours in the mesh.
        raise ValueError(
            f"{dim.name!r} shares parameters, so it must be registered before any split dimension that owns them"
        )
    DIMENSIONS.append(dim)
    return dim


def splits() -> list[Dimension]:
    """The split dimensions, innermost last."""
    return [d for d in DIMENSIONS if d.role == "split"]
