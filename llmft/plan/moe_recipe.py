"""The ``moe`` section and ``peft.target_experts`` / ``peft.train_router`` against the model's config,
when it can be read without a download (``model.config``, a local directory, the hub cache); else the
build checks them (``llmft.model.moe.install``, ``llmft.model.adapters``). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from llmft.errors import Problem, UserError
from llmft.plan.moe import expert_parallel_model_problems, family_problems, lora_problems, moe_family
from llmft.plan.shape import hub_cache_config, read_config

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


def moe_problems(recipe: Recipe, where: Callable[[str], str] = str) -> list[Problem]:
    """The ``moe`` section against the model, when its config can be read without a download
    (``model.config``, a local directory, the hub cache); else the build checks it
    (``llmft.model.moe.install``)."""
    config = _readable_config(recipe.model)
    if config is None:
        return []
    try:
        family = moe_family(config)
    except UserError as e:
        key = "model.config" if recipe.model.config is not None else "model.name_or_path"
        return [Problem(where(key), p.what, p.fix) for p in e.problems]
    moe = recipe.moe
    if family is not None:
        problems = [Problem(where(p.where), p.what, p.fix) for p in family_problems(family, moe)]
        return problems + _at(where, lora_problems(family, recipe.peft, family.model_type))
    asked = [f.name for f in fields(moe) if getattr(moe, f.name) != f.default]
    model_type = config.get("model_type")
    return _at(where, lora_problems(None, recipe.peft, model_type)) + [
        Problem(
            where(f"moe.{name}"),
            f"is set, but the model ({model_type!r}) is dense: it has no experts and no router, so there is "
            "no routing for moe.* to act on",
            f"Remove moe.{name} from the recipe (moe.* applies to mixture-of-experts models only, docs/moe.md).",
        )
        for name in asked
    ]


def _at(where: Callable[[str], str], problems: list[Problem]) -> list[Problem]:
    return [Problem(where(p.where), p.what, p.fix) for p in problems]


def _readable_config(model: Any) -> dict[str, Any] | None:
    if model.config is not None:
        return dict(model.config)
    if model.name_or_path is None:
        return None
    local = Path(model.name_or_path) / "config.json"
    path = local if local.is_file() else hub_cache_config(model.name_or_path)
    return read_config(path) if path is not None else None


def expert_parallel_problems(
    recipe: Recipe, spec: Any, world_size: int, where: Callable[[str], str] = str
) -> list[Problem]:
    """What ``distributed.expert_parallel`` asks that the engine, the rest of the recipe or the model
    cannot give (its divisibility by the shard dimension is the layout's check)."""
    n = recipe.distributed.expert_parallel
    if n <= 1:
        return []
    key = where("distributed.expert_parallel")
    if not spec.expert_parallel:
        return [
            Problem(
                key,
                f"is {n}, but expert parallelism is built on FSDP2 only (distributed.engine is {spec.name}; "
                "DeepSpeed's MoE layers are its own modules, not transformers' fused experts)",
                "Set distributed.engine=fsdp, or distributed.expert_parallel=1 (every rank then holds every expert, "
                "sharded like any other weight).",
            )
        ]
    problems = []
    if recipe.distributed.sequence_parallel > 1:
        problems.append(
            Problem(
                key,
                f"is {n} with distributed.sequence_parallel {recipe.distributed.sequence_parallel}: expert "
                "parallelism over sequence slices is not built",
                "Use one of them: distributed.expert_parallel=1 or distributed.sequence_parallel=1.",
            )
        )
    if recipe.model.quantization is not None:
        problems.append(
            Problem(
                key,
                f"is {n}, but the base is quantized (model.quantization.bits {recipe.model.quantization.bits}): "
                "expert parallelism over quantized experts is not built",
                "Set distributed.expert_parallel=1 (FSDP2 shards the quantized base), or train without "
                "model.quantization.",
            )
        )
    config = _readable_config(recipe.model)
    if config is None:  # the build checks the model (llmft.model.expert_parallel.install)
        return problems
    try:
        family = moe_family(config)
    except UserError:  # moe_problems reports it
        return problems
    return problems + _at(where, expert_parallel_model_problems(family, config, recipe.peft, n))
