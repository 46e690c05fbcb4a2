"""Checks that need more than a type: ranges, choices and combinations of the user's intent.

All problems are collected and raised together. Nothing here changes the recipe:
the engine, the batch and every other decision are made by ``llmft.plan.resolve``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from llmft.errors import Problem
from llmft.recipe.schema import Recipe, iter_fields

# The largest whole number a recipe takes: beyond it, torch, numpy and the OS take no such number.
MAX_INT = 2**63 - 1


def _get(recipe: Any, key: str) -> Any:
    obj = recipe
    for part in key.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part)
    return obj


def _choices(recipe: Recipe, where) -> list[Problem]:
    problems = []
    for key, f, _ in iter_fields(type(recipe)):  # with the sections of train.objective_module (recipe.sections)
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


def _bad_number(value: Any) -> str | None:
    """What is wrong with the first non-finite float or oversized int inside ``value``, if any."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"{value} is too large (at most 2**63 - 1)"
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((bad for v in items if (bad := _bad_number(v)) is not None), None)


def _numbers(r: Recipe, where) -> list[Problem]:
    """The schema-wide rule: every float is finite and every int fits 64 bits, unless a key's
    schema entry says otherwise (``allow_nonfinite``). Free-form values (``model.config``, the
    mappings of ``data.train``) are searched too, and a free-form key is named in full."""
    problems = []
    for key, f, sub in iter_fields(type(r)):
        if sub is not None or f.metadata.get("allow_nonfinite"):
            continue
        value = _get(r, key)
        leaves = value.items() if isinstance(value, dict) else [("", value)]
        for name, v in leaves:
            bad = _bad_number(v)
            if bad is not None:
                full = f"{key}.{name}" if name else key
                problems.append(Problem(where(full), bad, f"Set {full} to an ordinary number."))
    return problems


def _output_dir(r: Recipe, where) -> list[Problem]:
    """A run directory that cannot be created: found here, before any command writes anything."""
    path = Path(r.run.output_dir)
    try:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    except (OSError, ValueError) as e:  # a NUL byte, a name too long for the file system
        return [Problem(where("run.output_dir"), f"{r.run.output_dir!r} is not a usable path ({e})", "Rename it.")]
    if blocker is None:
        return []
    what = f"{str(blocker)!r} is a file, not a directory"
    return [Problem(where("run.output_dir"), what, "Set run.output_dir to a new directory or an llmft run directory.")]


def _seq_len_ok(value: Any) -> bool:
    if value == "auto":  # the planner picks it (llmft.plan.resolve)
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= 2


def _ranges(r: Recipe, where) -> list[Problem]:
    checks: list[tuple[str, bool, str]] = [
        # numpy seeds from 32 bits; a larger seed would fail after the run directory was claimed
        ("run.seed", 0 <= r.run.seed < 2**32, "must be in [0, 2**32)"),
        ("data.max_seq_len", _seq_len_ok(r.data.max_seq_len), "must be a whole number >= 2, or auto"),
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
        ("data.stream_block", r.data.stream_block >= 1, "must be >= 1"),
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
        ("distributed.sequence_parallel", r.distributed.sequence_parallel >= 1, "must be >= 1"),
        ("distributed.expert_parallel", r.distributed.expert_parallel >= 1, "must be >= 1"),
        (
            "distributed.timeout_s",
            1 <= r.distributed.timeout_s <= 31536000,
            "must be in [1, 31536000] (a year)",
        ),
        (
            "distributed.timeout_minutes",
            r.distributed.timeout_minutes is None or 1 <= r.distributed.timeout_minutes <= 525600,
            "must be in [1, 525600] (a year) or null",
        ),
        ("distributed.master_port", 1 <= r.distributed.master_port <= 65535, "must be in [1, 65535]"),
        (
            "distributed.gpu_memory_gb",
            r.distributed.gpu_memory_gb is None or r.distributed.gpu_memory_gb > 0,
            "must be > 0 or null",
        ),
    ]
    return [Problem(where(k), f"{_get(r, k)!r} {msg}", f"Change {k}.") for k, ok, msg in checks if not ok]


def _combinations(r: Recipe, where) -> list[Problem]:
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
    if m.activation_offload and not m.gradient_checkpointing:
        p.append(
            Problem(
                where("model.activation_offload"),
                "offloads the activations that gradient checkpointing saves, and model.gradient_checkpointing is false",
                "Set model.gradient_checkpointing=true, or model.activation_offload=false.",
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


def check_values(recipe: Recipe, where: Callable[[str], str] = lambda k: k) -> list[Problem]:
    """Values outside their choices or ranges; a path that cannot be a run directory."""
    numbers = _numbers(recipe, where)
    bad = {p.where for p in numbers}  # a range says nothing more about nan, inf or 10**30
    ranges = [p for p in _ranges(recipe, where) if p.where not in bad]
    return numbers + _choices(recipe, where) + ranges + _output_dir(recipe, where)


def check_combinations(recipe: Recipe, where: Callable[[str], str] = lambda k: k) -> list[Problem]:
    """Keys that do not go together. Those that depend on the world or on the engine ``auto``
    resolves to are found by ``llmft.plan.resolve``. Never changes the recipe."""
    return _combinations(recipe, where)
