"""PEFT: wrapping a model in a LoRA/DoRA adapter (on a mixture of experts, LoRA on the fused expert
weights too, and the router trained in full if asked), the adapters' seeded initial weights (the
same on every engine and world size), and the names of a PEFT model's parameters in its base
checkpoint (``base_key``)."""

from __future__ import annotations

import copy
import logging
import math
from typing import TYPE_CHECKING, Iterator

import torch

from llmft.errors import Problem, UserError, first_line
from llmft.plan.moe import MoEFamily, experts_adapted, lora_problems, moe_family

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PreTrainedModel

    from llmft.recipe.schema import PeftConfig

log = logging.getLogger("llmft")


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def apply_peft(model: PreTrainedModel, p: PeftConfig, task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """Wrap in a LoRA (or DoRA) adapter; only adapter weights (and modules_to_save) stay trainable.
    ``task_type``: PEFT's, for the model's head (``llmft.model.heads``); a score head's ``SEQ_CLS``
    trains the head in full and saves it with the adapter (PEFT adds it to ``modules_to_save``).

    On a mixture of experts (``llmft.plan.moe``), LoRA also goes on the fused ``[experts, ., .]``
    weights (``peft.target_experts``; PEFT's ``target_parameters``: one ``A``, ``B`` pair per expert),
    and ``peft.train_router`` trains the router in full (``modules_to_save``)."""
    # peft imports bitsandbytes where installed (seconds): only a PEFT run pays for it
    from peft import LoraConfig, get_peft_model

    family = moe_family(model.config)
    problems = lora_problems(family, p, getattr(model.config, "model_type", None))
    if problems:
        raise UserError(*problems)
    experts = experts_adapted(family, p)
    saved = [*(p.modules_to_save or []), *([family.router] if family is not None and p.train_router else [])]
    lora = LoraConfig(
        r=p.r,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=p.target_modules if isinstance(p.target_modules, str) else list(p.target_modules),
        target_parameters=list(family.expert_weights) if experts else None,
        modules_to_save=saved or None,
        use_dora=p.method == "dora",
        task_type=task_type,
    )
    if family is not None:
        lora.target_modules = _moe_targets(model, lora)
    try:
        wrapped = get_peft_model(model, lora)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if _is_linear(mod)})
        raise UserError(
            Problem(
                "peft.target_modules",
                f"{p.target_modules!r} cannot be adapted: {first_line(e)}",
                f"Use all-linear, or names of this model's linear layers: {', '.join(names)}.",
            )
        ) from None
    if family is not None:
        _log_moe_lora(wrapped, family, lora.target_modules, experts)
    return wrapped


def _moe_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str] | str:
    """The linear layers to adapt on a mixture of experts, as names. PEFT reads the string all-linear on
    a family whose layout changed in transformers 5 (qwen3_moe, mixtral, ...) as the transformers 4
    layers, router included: resolved here to the linear layers there are, the router stays out."""
    if not isinstance(lora.target_modules, str):
        return list(lora.target_modules)
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    resolved = _maybe_include_all_linear_layers(copy.copy(lora), model).target_modules
    if isinstance(resolved, str):  # a regex: PEFT matches it
        return resolved
    return sorted({name.rsplit(".", 1)[-1] for name in resolved})


def _log_moe_lora(model: torch.nn.Module, family: MoEFamily, asked: list[str] | str, experts: bool) -> None:
    config = model.peft_config["default"]
    # PEFT still reads names of the transformers 4 experts (gate_proj, up_proj, down_proj, w1...) as the
    # fused weights: a dense MLP or shared expert with such names gets no LoRA of its own.
    moved = sorted(set(asked) - set(config.target_modules or ())) if isinstance(asked, list) else []
    if moved:
        log.warning(
            "LoRA: PEFT reads %s on a %s model as the transformers 4 names of its experts: LoRA goes on the fused "
            "expert weights (target_parameters %s), not on the linear layers of these names",
            ", ".join(moved),
            family.model_type,
            sorted(config.target_parameters or ()),
        )
    if experts:  # under QLoRA, llmft.model.moe_quant then packs these weights in 4 bits and says so
        log.info("LoRA on the experts: %s of every MoE layer", ", ".join(family.expert_weights))


# Parameters that exist only in a PEFT model (the adapter's own weights), and the wrapper levels
# PEFT inserts into the path of the module it adapts.
ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
PEFT_WRAPPERS = frozenset({"base_layer", "original_module"})


def base_key(name: str, *, trained_copies: bool = True) -> str | None:
    """The name a parameter of a (PEFT-wrapped) model has in its base model's checkpoint.

    ``base_model.model.`` and PEFT's wrapper levels (``base_layer``, ``original_module``) are
    dropped. None for an adapter weight. A ``modules_to_save.<adapter>`` copy maps to the weight
    it was copied from (it starts as that weight), or to None with ``trained_copies=False``
    (the frozen base is the ``original_module``, not the trained copy).
    """
    parts = name.removeprefix("base_model.model.").split(".")
    if ADAPTER_PARTS.intersection(parts) or (not trained_copies and "modules_to_save" in parts):
        return None
    kept: list[str] = []
    skip_next = False
    for part in parts:
        if skip_next:
            skip_next = False
        elif part == "modules_to_save":
            skip_next = True  # the adapter name follows
        elif part not in PEFT_WRAPPERS:
            kept.append(part)
    return ".".join(kept)


def initial_adapter_weights(model: torch.nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The initial LoRA weights of a PEFT model by parameter name: full size, fp32, on CPU.

    PEFT's default init (A kaiming-uniform like ``nn.Linear``, B zeros; for embeddings A zeros,
    B normal), drawn from ``run.seed`` in module order rather than from the global RNG, so that
    a model built whole and one built on the meta device and sharded (FSDP2) start from the same
    adapters, on every engine and world size. DoRA magnitudes are not here: they are the norms
    of the base weights, which PEFT computes (or the sharding engine, once the weights are loaded).
    """
    # peft imports bitsandbytes where installed (seconds): only a PEFT run pays for it
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, layer in module.lora_A.items():
            a = torch.empty(layer.weight.shape)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            yield f"{name}.lora_A.{adapter}.weight", a
            for pname, p in module.lora_B[adapter].named_parameters():
                yield f"{name}.lora_B.{adapter}.{pname}", torch.zeros(p.shape)
        for adapter, a in module.lora_embedding_A.items():
            yield f"{name}.lora_embedding_A.{adapter}", torch.zeros(a.shape)
            b = module.lora_embedding_B[adapter]
            yield f"{name}.lora_embedding_B.{adapter}", torch.empty(b.shape).normal_(generator=generator)


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Give the adapters their seeded initial weights (see ``initial_adapter_weights``). Adapters
    still on the meta device are left to the engine that materialises them."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_adapter_weights(model, seed):
            p = params[name]
            if p.is_meta:
                return
            p.copy_(value)


def _is_linear(module: torch.nn.Module) -> bool:
    # bnb's Linear4bit / Linear8bitLt subclass nn.Linear
    return isinstance(module, torch.nn.Linear)
