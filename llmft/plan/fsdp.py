"""The FSDP2 plan of a resolved run, and the matching ``accelerate launch`` config.

``fsdp_plan`` is what llmft's FSDP engine applies at run time (``engines/fsdp.py`` reads
its mesh, mixed precision, offload and resharding from it) and what ``fsdp.yaml`` shows
(``FSDPPlan.to_dict``): ``fully_shard`` on every decoder layer, then on the root; the decoder
layer classes are read at run time from the model's ``_no_split_modules``, so the plan needs no
model import here.

``accelerate_config`` is for people who launch with ``accelerate launch``
(``accelerate launch --config_file accelerate.yaml -m llmft train DIR``): the
launch numbers come from it, the training setup still from the recipe. Pure:
no torch, no accelerate, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from llmft.plan.layout import RunPlan

# accelerate names "no mixed precision" differently from our fp32.
ACCELERATE_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
FSDP_PLAN = "fsdp.yaml"
ACCELERATE_CONFIG = "accelerate.yaml"


@dataclass(frozen=True)
class Mesh:
    """HSDP when replicate > 1: replicate across groups, shard within a group."""

    replicate: int
    shard: int


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: str  # model.dtype
    reduce_dtype: str  # distributed.reduce_dtype


@dataclass(frozen=True)
class FSDPPlan:
    """What to shard, mixed precision, offload, the device mesh and the batch."""

    reshard_after_forward: bool
    mixed_precision: MixedPrecision
    cpu_offload: bool
    activation_checkpointing: bool
    mesh: Mesh
    batch: dict[str, int]  # BatchPlan.to_dict(): for the reader of fsdp.yaml
    # Order matters: layers first so each gets its own all-gather; the root then
    # takes the remaining params (embeddings, final norm, head).
    shard: tuple[str, ...] = ("decoder_layers", "root")
    version: int = 2

    def to_dict(self) -> dict[str, Any]:
        """``fsdp.yaml``'s content, in its order."""
        return {
            "version": self.version,
            "shard": list(self.shard),
            "reshard_after_forward": self.reshard_after_forward,
            "mixed_precision": {
                "param_dtype": self.mixed_precision.param_dtype,
                "reduce_dtype": self.mixed_precision.reduce_dtype,
            },
            "cpu_offload": self.cpu_offload,
            "activation_checkpointing": self.activation_checkpointing,
            "mesh": {"replicate": self.mesh.replicate, "shard": self.mesh.shard},
            "batch": dict(self.batch),
        }


def fsdp_plan(plan: RunPlan) -> FSDPPlan:
    """The FSDP2 plan of a resolved run: its mesh is the run's parallel layout."""
    recipe, b, layout = plan.recipe, plan.batch, plan.layout
    d = recipe.distributed
    assert b.dp_size == layout.dp_size, "the batch is solved for the layout's data-parallel ranks"
    assert layout.dp_size % layout.dp_replicate == 0, "resolve() checks hsdp_replicate divides dp_size"
    return FSDPPlan(
        reshard_after_forward=d.reshard_after_forward,
        mixed_precision=MixedPrecision(param_dtype=recipe.model.dtype, reduce_dtype=d.reduce_dtype),
        cpu_offload=d.offload_params == "cpu",
        activation_checkpointing=recipe.model.gradient_checkpointing,
        mesh=Mesh(replicate=layout.dp_replicate, shard=layout.dp_shard),
        batch=b.to_dict(),
    )


def accelerate_config(run: RunPlan, plan: FSDPPlan) -> dict[str, Any]:
    """An ``accelerate launch`` config (FSDP2) with the same layout and sharding as ``plan``.

    No ``fsdp_transformer_layer_cls_to_wrap``: accelerate then wraps the model's
    ``_no_split_modules``, the same classes llmft's plan resolves. Multi-node
    users pass ``--machine_rank`` and ``--main_process_ip`` on each node.
    """
    d = run.recipe.distributed
    fsdp_config: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": plan.reshard_after_forward,
        "fsdp_offload_params": plan.cpu_offload,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_activation_checkpointing": plan.activation_checkpointing,
        # Rank 0 reads the checkpoint, the others build on the meta device.
        "fsdp_cpu_ram_efficient_loading": True,
    }
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": ACCELERATE_MIXED_PRECISION[run.dtype],
        "use_cpu": False,
        "debug": False,
        "num_machines": run.world.nnodes,
        "num_processes": run.layout.world_size,
        "machine_rank": 0,
        "main_process_port": d.master_port,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "fsdp_config": fsdp_config,
    }
    if plan.mesh.replicate > 1:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": plan.mesh.replicate,
            "parallelism_config_dp_shard_size": plan.mesh.shard,
        }
    return config


def _header(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def config_files(plan: RunPlan, head: list[str]) -> dict[str, str]:
    """``fsdp.yaml`` and ``accelerate.yaml`` (``EngineSpec.config_files``)."""
    sharding = fsdp_plan(plan)
    how = [f"accelerate launch --config_file {ACCELERATE_CONFIG} -m llmft train <this directory>"]
    if plan.world.nnodes > 1:
        how.append("On each node add --machine_rank <0..num_machines-1> --main_process_ip <host of node 0>.")
    return {
        FSDP_PLAN: _header([*head, "The FSDP2 plan llmft applies at run time (recomputed from recipe.yaml)."])
        + _yaml(sharding.to_dict()),
        ACCELERATE_CONFIG: _header([*head, *how]) + _yaml(accelerate_config(plan, sharding)),
    }


def summary(plan: RunPlan) -> str:
    """The compile summary's engine line: the mesh."""
    mesh = fsdp_plan(plan).mesh
    return f"engine: {plan.engine} (FSDP2, mesh {mesh.replicate} replica(s) x {mesh.shard} shard(s))"
