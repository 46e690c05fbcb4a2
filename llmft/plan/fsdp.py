"""The FSDP2 plan of a resolved run, and the matching ``accelerate launch`` config.

``fsdp_plan`` is what llmft's FSDP engine applies at run time (``engines/fsdp.py`` reads
its mesh, mixed precision, offload and resharding from it) and what ``fsdp.yaml`` shows:
``fully_shard`` on every decoder layer, then on the root; the decoder layer classes are
read at run time from the model's ``_no_split_modules``, so the plan needs no model
import here.

``accelerate_config`` is for people who launch with ``accelerate launch``
(``accelerate launch --config_file accelerate.yaml -m llmft train DIR``): the
launch numbers come from it, the training setup still from the recipe. Pure:
no torch, no accelerate, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmft.plan.resolve import RunPlan

# accelerate names "no mixed precision" differently from our fp32.
ACCELERATE_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def fsdp_plan(plan: RunPlan) -> dict[str, Any]:
    """The FSDP2 plan: what to shard, mixed precision, offload, the device mesh and the batch."""
    recipe, b = plan.recipe, plan.batch
    d = recipe.distributed
    dp_size = plan.dp_size
    assert dp_size % d.hsdp_replicate == 0, "resolve() checks hsdp_replicate divides dp_size"
    return {
        "version": 2,
        # Order matters: layers first so each gets its own all-gather; the root then
        # takes the remaining params (embeddings, final norm, head).
        "shard": ["decoder_layers", "root"],
        "reshard_after_forward": d.reshard_after_forward,
        "mixed_precision": {"param_dtype": recipe.model.dtype, "reduce_dtype": d.reduce_dtype},
        "cpu_offload": d.offload_params == "cpu",
        "activation_checkpointing": recipe.model.gradient_checkpointing,
        # HSDP when replicate > 1: replicate across groups, shard within a group.
        "mesh": {"replicate": d.hsdp_replicate, "shard": dp_size // d.hsdp_replicate},
        "batch": {
            "global_batch_size": b.global_batch_size,
            "micro_batch_size": b.micro_batch_size,
            "gradient_accumulation_steps": b.gradient_accumulation_steps,
            "dp_size": dp_size,
        },
    }


def accelerate_config(run: RunPlan, plan: dict[str, Any]) -> dict[str, Any]:
    """An ``accelerate launch`` config (FSDP2) with the same layout and sharding as ``plan``.

    No ``fsdp_transformer_layer_cls_to_wrap``: accelerate then wraps the model's
    ``_no_split_modules``, the same classes llmft's plan resolves. Multi-node
    users pass ``--machine_rank`` and ``--main_process_ip`` on each node.
    """
    d = run.recipe.distributed
    fsdp_config: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": plan["reshard_after_forward"],
        "fsdp_offload_params": plan["cpu_offload"],
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_activation_checkpointing": plan["activation_checkpointing"],
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
        "num_processes": plan["batch"]["dp_size"],
        "machine_rank": 0,
        "main_process_port": d.master_port,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "fsdp_config": fsdp_config,
    }
    mesh = plan["mesh"]
    if mesh["replicate"] > 1:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": mesh["replicate"],
            "parallelism_config_dp_shard_size": mesh["shard"],
        }
    return config
