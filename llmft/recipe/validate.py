"""Checks that need more than a type: ranges, choices, combinations, and the batch equation.

All problems are collected and raised together. The batch keys come out solved
(no ``auto`` left) and the engine comes out concrete.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from llmft import kernels  # issue 15: speed-switch combinations
from llmft.errors import Problem, UserError
from llmft.plan.batch import BatchPlan, resolve_for_world, sequences_from_tokens, solve_batch
from llmft.recipe.schema import Recipe, iter_fields

log = logging.getLogger("llmft")


def _get(recipe: Any, key: str) -> Any:
    obj = recipe
    for part in key.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part)
    return obj


def _choices(recipe: Recipe, where) -> list[Problem]:
    problems = []
    for key, f, _ in iter_fields():
        choices = f.metadata.get("choices")
        if choices is None:
            continue
        parent = _get(recipe, key.rsplit(".", 1)[0]) if "." in key else recipe
        if parent is None:
            continue
        value = getattr(parent, f.name)
        if value not in choices:
            shown = ", ".join("null" if c is None else str(c) for c in choices)
            problems.append(Problem(where(key), f"{value!r} is not one of {shown}", f"Set {key} to one of: {shown}."))
    return problems


def _ranges(r: Recipe, where) -> list[Problem]:
    checks: list[tuple[str, bool, str]] = [
        ("run.seed", r.run.seed >= 0, "must be >= 0"),
        ("data.max_seq_len", r.data.max_seq_len >= 2, "must be >= 2"),
        ("data.eval_fraction", 0.0 <= r.data.eval_fraction < 1.0, "must be in [0, 1)"),
        ("data.num_workers", r.data.num_workers >= 0, "must be >= 0"),
        ("data.prefetch_factor", r.data.prefetch_factor >= 1, "must be >= 1"),
        ("peft.r", r.peft.r >= 1, "must be >= 1"),
        ("peft.dropout", 0.0 <= r.peft.dropout < 1.0, "must be in [0, 1)"),
        ("optim.lr", r.optim.lr > 0, "must be > 0"),
        ("optim.weight_decay", r.optim.weight_decay >= 0, "must be >= 0"),
        ("optim.warmup_steps", r.optim.warmup_steps >= 0, "must be >= 0"),
        ("optim.min_lr_ratio", 0.0 <= r.optim.min_lr_ratio <= 1.0, "must be in [0, 1]"),
        ("optim.max_grad_norm", r.optim.max_grad_norm is None or r.optim.max_grad_norm > 0, "must be > 0 or null"),
        ("optim.lr_scaling_base_batch", r.optim.lr_scaling_base_batch >= 1, "must be >= 1"),
        (
            "optim.betas",
            len(r.optim.betas) == 2 and all(0 <= b < 1 for b in r.optim.betas),
            "must be two numbers in [0, 1)",
        ),
        ("train.max_steps", r.train.max_steps is None or r.train.max_steps >= 1, "must be >= 1"),
        ("train.epochs", r.train.epochs is None or r.train.epochs > 0, "must be > 0"),
        ("train.log_every_steps", r.train.log_every_steps >= 1, "must be >= 1"),
        (
            "train.eval_every_steps",
            r.train.eval_every_steps is None or r.train.eval_every_steps >= 1,
            "must be >= 1 or null",
        ),
        ("train.eval_generate_samples", r.train.eval_generate_samples >= 0, "must be >= 0"),
        (
            "checkpoint.every_steps",
            r.checkpoint.every_steps is None or r.checkpoint.every_steps >= 1,
            "must be >= 1 or null",
        ),
        ("checkpoint.keep_last", r.checkpoint.keep_last is None or r.checkpoint.keep_last >= 1, "must be >= 1 or null"),
        ("distributed.nnodes", r.distributed.nnodes >= 1, "must be >= 1"),
        ("distributed.nproc_per_node", r.distributed.nproc_per_node >= 1, "must be >= 1"),
        ("distributed.hsdp_replicate", r.distributed.hsdp_replicate >= 1, "must be >= 1"),
        ("distributed.timeout_minutes", r.distributed.timeout_minutes >= 1, "must be >= 1"),
    ]
    return [Problem(where(k), f"{_get(r, k)!r} {msg}", f"Change {k}.") for k, ok, msg in checks if not ok]


def _combinations(r: Recipe, where, dp_size: int) -> list[Problem]:
    p: list[Problem] = []
    m = r.model
    if (m.name_or_path is None) == (m.config is None):
        p.append(
            Problem(
                where("model.name_or_path"),
                "set exactly one of model.name_or_path and model.config",
                "Use name_or_path for a pretrained model, or model.config (with model_type) for a fresh one.",
            )
        )
    if m.config is not None and "model_type" not in m.config:
        p.append(Problem(where("model.config"), "has no model_type", "Add model_type (e.g. llama) to model.config."))
    if m.quantization is not None and r.peft.method == "none":
        p.append(
            Problem(
                where("model.quantization"),
                "quantized weights cannot be fully fine-tuned",
                "Set peft.method=lora (QLoRA) or model.quantization=null.",
            )
        )
    if r.data.train is None:
        p.append(
            Problem(
                where("data.train"),
                "no training data given",
                "Set data.train to a JSONL/JSON/Parquet file or directory.",
            )
        )
    if r.train.max_steps is None and r.train.epochs is None:
        p.append(
            Problem(
                where("train.max_steps"),
                "the run has no length",
                "Set train.max_steps (optimizer steps) or train.epochs.",
            )
        )
    if r.checkpoint.resume not in ("auto", "never") and not r.checkpoint.resume:
        p.append(Problem(where("checkpoint.resume"), "is empty", "Use auto, never, or a checkpoint path."))
    if not (
        isinstance(r.peft.target_modules, str)
        or (isinstance(r.peft.target_modules, list) and all(isinstance(t, str) for t in r.peft.target_modules))
    ):
        p.append(
            Problem(
                where("peft.target_modules"),
                f"{r.peft.target_modules!r} is not a name or a list of names",
                "Use all-linear or a list such as [q_proj, v_proj].",
            )
        )
    d = r.distributed
    if d.engine == "single" and dp_size > 1:
        p.append(
            Problem(
                where("distributed.engine"),
                f"single cannot run on {dp_size} processes",
                "Use distributed.engine=ddp, fsdp or deepspeed (or auto).",
            )
        )
    if d.offload_params != "none" and d.engine in ("single", "ddp"):
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"the {d.engine} engine keeps whole replicas and cannot offload parameters",
                "Use distributed.engine=fsdp or deepspeed with zero_stage=3.",
            )
        )
    if d.offload_params != "none" and d.engine == "deepspeed" and d.zero_stage != 3:
        p.append(
            Problem(
                where("distributed.offload_params"),
                f"needs ZeRO stage 3, got {d.zero_stage}",
                "Set distributed.zero_stage=3 or distributed.offload_params=none.",
            )
        )
    if d.engine == "fsdp" and "nvme" in (d.offload_params, d.offload_optimizer):
        p.append(
            Problem(
                where("distributed.offload_params"),
                "FSDP2 offloads to cpu only",
                "Use cpu, or distributed.engine=deepspeed for nvme.",
            )
        )
    if d.engine in ("single", "ddp", "fsdp") and d.offload_optimizer != "none":
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                f"optimizer offload needs DeepSpeed, engine is {d.engine}",
                "Set distributed.engine=deepspeed, or offload_optimizer=none (FSDP: use offload_params=cpu).",
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
    # FSDP2 turns every param into a DTensor even on one rank, which drops the int8 weights' scales.
    if (
        m.quantization is not None
        and m.quantization.bits == 8
        and (d.engine == "fsdp" or (d.engine == "deepspeed" and dp_size > 1))
    ):
        p.append(
            Problem(
                where("model.quantization.bits"),
                f"8-bit weights cannot be sharded by {d.engine}",
                "Use bits: 4 (its storage dtype can be sharded) or distributed.engine=ddp.",
            )
        )
    if m.quantization is not None and d.engine == "deepspeed" and d.zero_stage == 3:
        p.append(
            Problem(
                where("model.quantization"),
                "QLoRA under DeepSpeed ZeRO-3 is not supported by llmft",
                "Use distributed.engine=fsdp for sharded QLoRA, or zero_stage 0-2.",
            )
        )
    if r.optim.name.startswith("paged") or r.optim.name.endswith("8bit"):
        if d.engine == "deepspeed" and d.offload_optimizer != "none":
            p.append(
                Problem(
                    where("optim.name"),
                    "bitsandbytes optimizers cannot be offloaded by DeepSpeed",
                    "Use optim.name=adamw with offload, or offload_optimizer=none.",
                )
            )
    if d.engine == "deepspeed" and d.offload_optimizer != "none" and d.zero_stage == 0:
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                "ZeRO stage 0 has no optimizer partitions to offload (DeepSpeed would silently keep them on the GPU)",
                "Set distributed.zero_stage to 1, 2 or 3, or offload_optimizer=none.",
            )
        )
    if d.engine == "deepspeed" and d.offload_optimizer == "nvme" and d.zero_stage in (1, 2):
        p.append(
            Problem(
                where("distributed.offload_optimizer"),
                f"nvme optimizer offload needs ZeRO stage 3 (stage {d.zero_stage} would silently offload to CPU RAM)",
                "Set distributed.zero_stage=3, or offload_optimizer=cpu.",
            )
        )
    if d.hsdp_replicate > 1 and d.engine != "fsdp":
        p.append(
            Problem(
                where("distributed.hsdp_replicate"),
                f"HSDP replica groups are an FSDP2 setting; engine is {d.engine}, which would ignore it",
                "Set distributed.engine=fsdp, or distributed.hsdp_replicate=1.",
            )
        )
    q = m.quantization
    if q is not None and d.engine == "fsdp" and q.quant_storage not in (None, m.dtype):
        p.append(
            Problem(
                where("model.quantization.quant_storage"),
                f"{q.quant_storage} differs from model.dtype {m.dtype}: FSDP2 shards 4-bit weights only when they "
                "are stored in the dtype of the other parameters",
                f"Set model.quantization.quant_storage={m.dtype} or null (null picks it automatically).",
            )
        )
    if r.batch.global_batch_tokens is not None and not r.data.packing:
        p.append(
            Problem(
                where("batch.global_batch_tokens"),
                "a token budget needs data.packing=true (rows of max_seq_len)",
                "Set data.packing=true, or use batch.global_batch_size.",
            )
        )
    return p


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


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"


def _planned_micro(r: Recipe, global_batch_size: int, dp_size: int) -> int | str:
    """micro_batch_size=auto with accumulation auto: the largest micro-batch that fits the GPU
    (distributed.gpu_memory_gb, or the detected device when torch is already loaded: compile never
    imports it). Without a memory size it stays auto and the solver asks for a number."""
    gpu_gb = r.distributed.gpu_memory_gb
    if gpu_gb is None and "torch" in sys.modules:
        from llmft.plan.memory import detected_gpu_memory_gb

        gpu_gb = detected_gpu_memory_gb()
    if gpu_gb is None:
        return "auto"
    from llmft.plan.memory import pick_micro_batch

    r.batch.global_batch_size = global_batch_size
    micro = pick_micro_batch(r, dp_size, gpu_gb)
    log.info("batch.micro_batch_size=auto: %d is the largest that fits %.0f GiB per GPU", micro, gpu_gb)
    return micro


def _batch(r: Recipe, where, dp_size: int) -> list[Problem]:
    b = r.batch
    g = b.global_batch_size
    try:
        if b.global_batch_tokens is not None and r.data.packing:
            from_tokens = sequences_from_tokens(b.global_batch_tokens, r.data.max_seq_len)
            if g not in (None, "auto") and g != from_tokens:
                return [
                    Problem(
                        where("batch.global_batch_tokens"),
                        f"{b.global_batch_tokens} tokens / max_seq_len {r.data.max_seq_len} = {from_tokens} sequences, "
                        f"but batch.global_batch_size is {g}",
                        "Set only one of the two.",
                    )
                ]
            g = from_tokens
        compiled_dp = r.distributed.nnodes * r.distributed.nproc_per_node
        micro = b.micro_batch_size
        if _is_auto(micro) and _is_auto(b.gradient_accumulation_steps) and not _is_auto(g):
            micro = _planned_micro(r, g, dp_size)
        values = (g, micro, b.gradient_accumulation_steps)
        if all(isinstance(v, int) for v in values) and compiled_dp != dp_size:
            plan = solve_batch(*values, dp_size=compiled_dp)
            plan, note = resolve_for_world(plan, dp_size)
            if note:
                log.warning(note)
        else:
            plan = solve_batch(*values, dp_size=dp_size)
    except UserError as e:
        return [
            Problem(where(pr.where) if pr.where.startswith("batch.") else pr.where, pr.what, pr.fix)
            for pr in e.problems
        ]
    b.global_batch_size = plan.global_batch_size
    b.micro_batch_size = plan.micro_batch_size
    b.gradient_accumulation_steps = plan.gradient_accumulation_steps
    return []


def batch_plan(r: Recipe, dp_size: int | None = None) -> BatchPlan:
    """The plan of a validated recipe (all three keys concrete); dp_size defaults to its layout."""
    b = r.batch
    if dp_size is None:
        dp_size = r.distributed.nnodes * r.distributed.nproc_per_node
    return BatchPlan(b.global_batch_size, b.micro_batch_size, b.gradient_accumulation_steps, dp_size)


def validate(recipe: Recipe, sources=None, dp_size: int | None = None) -> Recipe:
    """Check everything; solve the batch and the engine in place. Raises RecipeError."""
    from llmft.recipe.load import RecipeError

    where = sources.of if sources is not None else (lambda k: k)
    if dp_size is None:
        dp_size = recipe.distributed.nnodes * recipe.distributed.nproc_per_node
    problems = _choices(recipe, where) + _ranges(recipe, where)
    if not problems:
        recipe.distributed.engine = resolve_engine(recipe, dp_size)
        problems += _combinations(recipe, where, dp_size)
        problems += [Problem(where(pr.where), pr.what, pr.fix) for pr in kernels.recipe_problems(recipe)]  # issue 15
        problems += _batch(recipe, where, dp_size)
    if problems:
        raise RecipeError(*problems, title=f"the recipe has {len(problems)} problem(s)")
    if recipe.distributed.nnodes * recipe.distributed.nproc_per_node != dp_size:
        # Record the layout this run really has (the written recipe must match it).
        recipe.distributed.nnodes, recipe.distributed.nproc_per_node = 1, dp_size
    return recipe
