"""The DeepSpeed config of a validated recipe: concrete numbers only, never ``"auto"``.

The same function writes ``ds_config.json`` at compile time and builds the dict
the DeepSpeed engine passes to ``deepspeed.initialize`` at run time (from the
run's plan, whose batch was re-solved for the real world size), so the file a
user reads is the config that runs. It is pure: no torch, no deepspeed, no I/O.

What is deliberately absent:

- ``optimizer`` / ``scheduler``: llmft builds the torch optimizer and the LR
  schedule itself and hands the optimizer to ``deepspeed.initialize``, so that
  every engine steps the same optimizer and schedule.
- ``"auto"``: HF's late resolution is what makes the trainer and the JSON
  disagree; the bucket sizes it would derive from the hidden size are computed
  here instead.
- ``elasticity``: it would let DeepSpeed pick its own batch; the batch equation
  is ours (and DeepSpeed >= 0.19 rejects the block anyway).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from llmft.errors import Problem
from llmft.plan.layout import RunPlan
from llmft.plan.shape import ModelShape, model_shape
from llmft.recipe.schema import Recipe

# stage3_max_live_parameters and stage3_max_reuse_distance on a GPU, as HF's auto sets them; the
# memory planner counts that many gathered parameters (the whole model when smaller). A CPU run
# bounds both to one decoder layer (host_live_window).
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Used for the bucket sizes when the model's hidden size cannot be known without a
# download: the sizes HF's "auto" gives for a 7-8B model, a sensible middle ground.
FALLBACK_HIDDEN_SIZE = 4096
# DeepSpeed prints every N steps; llmft logs itself, so effectively never.
STEPS_PER_PRINT = 1_000_000_000
DS_CONFIG = "ds_config.json"


def _offload(device: str, recipe: Recipe) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = recipe.distributed.nvme_path
    return block


def host_live_window(recipe: Recipe, shape: ModelShape | None) -> int:
    """ZeRO-3's live window and reuse distance where the device is the host (a CPU run): one
    decoder layer, in the elements ZeRO-3 stores (a 4- or 8-bit base's packed bytes in
    ``model.dtype`` elements, its quantization storage), and never less than the prefetch bucket.

    DeepSpeed keeps a gathered parameter until it is next used more than
    ``stage3_max_reuse_distance`` elements later, and prefetches while fewer than
    ``stage3_max_live_parameters`` are gathered. HF's 1e9 keeps every parameter of a model below
    1e9 gathered from its forward to its backward once DeepSpeed has traced a step: on a GPU that
    is device memory the planner counts and saves a gather per layer in backward; on a CPU it is
    host RAM, the whole model per rank from the second step on. With one layer a rank holds its
    partition plus about the module being computed and the next layer, as FSDP2 does, and gathers
    each layer again in backward, as FSDP2 does."""
    h = shape.hidden_size if shape is not None else FALLBACK_HIDDEN_SIZE
    bucket = int(0.9 * h * h)
    if shape is None:
        return bucket
    linear = shape.layer_linear_params
    q = recipe.model.quantization
    if q is not None:  # packed: bits / 8 bytes a weight, stored as model.dtype elements
        linear = -(-linear * q.bits // (8 * DTYPE_BYTES[recipe.model.dtype]))
    return max(linear + 2 * h, bucket)


def persistence_threshold(shape: ModelShape | None) -> int:
    """``stage3_param_persistence_threshold``: ZeRO-3 keeps a parameter of at most this many
    elements whole on every rank, beside its partition (norms, LoRA's small matrices), instead of
    gathering it for each use."""
    return 10 * (shape.hidden_size if shape is not None else FALLBACK_HIDDEN_SIZE)


def reduce_bucket_bytes(recipe: Recipe, shape: ModelShape | None) -> int:
    """What DeepSpeed's gradient reduce buckets hold on each rank whatever the model's size
    (``reduce_bucket_size`` elements each, ``zero_optimization``): ZeRO-3 one bucket in the
    gradients' dtype; ZeRO-1 and 2 two (``overlap_comm`` double-buffers them), fp32 under ZeRO-1
    (its accumulator), the gradients' dtype under ZeRO-2. None at ZeRO-0."""
    stage = recipe.distributed.zero_stage
    if stage == 0:
        return 0
    h = shape.hidden_size if shape is not None else FALLBACK_HIDDEN_SIZE
    grad = DTYPE_BYTES[recipe.model.dtype]
    return h * h * (grad if stage == 3 else 2 * (4 if stage == 1 else grad))


def zero_optimization(recipe: Recipe, shape: ModelShape | None, *, device_is_host: bool = False) -> dict[str, Any]:
    """The ``zero_optimization`` block for stages 0-3, bucket sizes from the hidden size.

    The sizes are what HF's ``auto`` would give: reduce bucket h*h, stage-3 prefetch
    0.9*h*h, and params smaller than 10*h kept whole on every rank. ``device_is_host``: a CPU
    run's ZeRO-3 keeps about one decoder layer gathered (``host_live_window``), not HF's 1e9, and
    prefetches nothing.
    """
    d = recipe.distributed
    stage = d.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return zero
    h = shape.hidden_size if shape is not None else FALLBACK_HIDDEN_SIZE
    bucket = h * h
    zero.update(
        overlap_comm=True,
        contiguous_gradients=True,
        reduce_scatter=True,
        reduce_bucket_size=bucket,
    )
    if stage < 3:
        zero["allgather_partitions"] = True
        zero["allgather_bucket_size"] = bucket
    else:
        window = host_live_window(recipe, shape) if device_is_host else ZERO3_MAX_LIVE_PARAMETERS
        zero.update(
            # On a CPU run (gloo) a gather runs at once, overlapping nothing: a prefetch would only
            # hold the next module's weights gathered sooner, as FSDP2's CPU units do not.
            stage3_prefetch_bucket_size=0 if device_is_host else int(0.9 * h * h),
            stage3_param_persistence_threshold=persistence_threshold(shape),
            stage3_max_live_parameters=window,
            stage3_max_reuse_distance=window,
            sub_group_size=1_000_000_000,
            # llmft consolidates ZeRO-3 shards itself at export; gathering 16-bit
            # weights on every save would materialise the whole model on rank 0.
            stage3_gather_16bit_weights_on_model_save=False,
        )
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(d.offload_optimizer, recipe)
    if stage == 3 and d.offload_params != "none":
        zero["offload_param"] = _offload(d.offload_params, recipe)
    return zero


def precision(dtype: str) -> dict[str, Any]:
    """``bf16`` and ``fp16`` blocks, both always present so nothing falls back to a default."""
    fp16: dict[str, Any] = {"enabled": dtype == "fp16"}
    if dtype == "fp16":
        # loss_scale 0 means dynamic loss scaling: start at 2**16, halve on overflow,
        # double after a window of clean steps.
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    return {"bf16": {"enabled": dtype == "bf16"}, "fp16": fp16}


def deepspeed_config(plan: RunPlan, *, device_is_host: bool = False) -> dict[str, Any]:
    """The complete DeepSpeed config of a resolved run (its batch solved for its world size).
    ``ds_config.json`` is the GPU run's; a CPU run (``device_is_host``) differs only in ZeRO-3's
    live window (``host_live_window``) and prefetch (none)."""
    recipe, batch = plan.recipe, plan.batch  # BatchPlan asserts the equation holds
    shape = model_shape(recipe.model)
    max_norm = plan.max_grad_norm  # the same value the other engines clip with
    return {
        "train_batch_size": batch.global_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": float(max_norm) if max_norm is not None else 0.0,
        "zero_optimization": zero_optimization(recipe, shape, device_is_host=device_is_host),
        **precision(recipe.model.dtype),
        # The optimizer is llmft's own torch (or bitsandbytes) optimizer.
        "zero_allow_untested_optimizer": True,
        # ... and it stays ours under optimizer offload too, instead of DeepSpeed
        # refusing anything that is not its DeepSpeedCPUAdam.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        # Ulysses: DeepSpeed counts world / N data-parallel ranks in train_batch_size (as llmft does)
        # and reduces gradients over the whole world (docs/long-context.md).
        **({"sequence_parallel_size": plan.sequence_parallel} if plan.sequence_parallel > 1 else {}),
    }


def config_files(plan: RunPlan, head: list[str]) -> dict[str, str]:
    """``ds_config.json`` (``EngineSpec.config_files``). JSON has no comments: the equation is in
    recipe.yaml and in the batch keys themselves."""
    return {DS_CONFIG: json.dumps(deepspeed_config(plan), indent=2) + "\n"}


def summary(plan: RunPlan) -> str:
    """The compile summary's engine line: stage and offload."""
    d = plan.recipe.distributed
    line = f"engine: {plan.engine}, ZeRO stage {d.zero_stage}"
    offload = [
        f"{what} -> {where}"
        for what, where in (("optimizer", d.offload_optimizer), ("params", d.offload_params))
        if where != "none"
    ]
    return line + (f" (offload {', '.join(offload)})" if offload else "")


def engine_problems(r: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What DeepSpeed refuses, or would silently do otherwise, at the recipe's ZeRO stage."""
    p: list[Problem] = []
    d = r.distributed
    if d.offload_params != "none" and d.zero_stage != 3:
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"needs ZeRO stage 3, got {d.zero_stage}",
                "Set distributed.zero_stage=3 or distributed.offload_params=none.",
            )
        )
    bitsandbytes = r.optim.name.startswith("paged") or r.optim.name.endswith("8bit")
    if bitsandbytes and d.offload_optimizer != "none":
        p.append(
            Problem(
                where("optim.name"),
                "bitsandbytes optimizers cannot be offloaded by DeepSpeed",
                "Use optim.name=adamw with offload, or offload_optimizer=none.",
            )
        )
    if d.offload_optimizer != "none" and d.zero_stage == 0:
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                "ZeRO stage 0 has no optimizer partitions to offload (DeepSpeed would silently keep them on the GPU)",
                "Set distributed.zero_stage to 1, 2 or 3, or offload_optimizer=none.",
            )
        )
    if d.offload_optimizer == "nvme" and d.zero_stage in (1, 2):
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                f"nvme optimizer offload needs ZeRO stage 3 (stage {d.zero_stage} would silently offload to CPU RAM)",
                "Set distributed.zero_stage=3, or offload_optimizer=cpu.",
            )
        )
    return p
