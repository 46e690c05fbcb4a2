"""The speed switches' own refusals (``model.compile``, ``model.liger_kernels``): combinations that
cannot work on the resolved engine, whatever the machine. Pure, no torch, so ``llmft compile`` stays
fast and runs on machines without a GPU; what the machine lacks and applying the switches to a built
model are ``llmft.model.kernels``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmft.errors import Problem

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


def recipe_problems(r: Recipe, engine: str) -> list[Problem]:
    """Switch combinations that cannot work on ``engine`` (the resolved one), whatever the machine."""
    p: list[Problem] = []
    m = r.model
    if m.compile and engine == "deepspeed":
        # DeepSpeed runs its own hooks around every submodule (ZeRO-3 gathers parameters in them)
        # and has its own compile entry point; llmft does not compile layers underneath it.
        p.append(
            Problem(
                "model.compile",
                "is not supported with distributed.engine=deepspeed (DeepSpeed's per-module ZeRO hooks would "
                "run inside the compiled layers)",
                "Set model.compile=false, or use distributed.engine=fsdp (sharded like ZeRO-3) or ddp.",
            )
        )
    if m.liger_kernels and engine == "deepspeed" and r.distributed.zero_stage == 3:
        p.append(
            Problem(
                "model.liger_kernels",
                "cannot run under DeepSpeed ZeRO-3: the fused linear cross-entropy reads lm_head.weight "
                "directly, outside the module call in which ZeRO-3 gathers it",
                "Use distributed.engine=fsdp, a ZeRO stage below 3, or model.liger_kernels=false.",
            )
        )
    targets = r.peft.target_modules
    adapts_head = isinstance(targets, (list, tuple)) and any(str(t).split(".")[-1] == "lm_head" for t in targets)
    if m.liger_kernels and r.peft.method != "none" and adapts_head:
        p.append(
            Problem(
                "model.liger_kernels",
                "cannot be combined with a LoRA adapter on lm_head: the fused linear cross-entropy multiplies "
                "by lm_head.weight alone, so the adapter would get no gradient",
                "Remove lm_head from peft.target_modules (peft.modules_to_save: [lm_head] works), or set "
                "model.liger_kernels=false.",
            )
        )
    return p
