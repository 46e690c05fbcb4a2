"""The speed and memory switches' own refusals (``model.compile``, ``model.liger_kernels``,
``model.tiled_mlp``): combinations that
cannot work on the resolved engine, whatever the machine. Pure, no torch, so ``llmft compile`` stays
fast and runs on machines without a GPU; what the machine lacks and applying the switches to a built
model are ``llmft.model.kernels``. Also which attention ``model.attn_implementation: auto`` runs
(``chosen_attention``; ``llmft.model.attention`` gives it the machine's facts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmft.errors import Problem

if TYPE_CHECKING:
    from llmft.plan.engines import EngineSpec
    from llmft.recipe.schema import ModelConfig, Recipe


@dataclass(frozen=True)
class KernelPaths:
    """Which implementation each part of the model runs, from ``model.compile`` and
    ``model.liger_kernels``: one path per module, never Liger's Triton kernels inside an inductor graph.

    Liger's RMSNorm, RoPE and SwiGLU live inside the decoder layers, which ``model.compile`` compiles;
    inductor cannot trace Liger's RMSNorm kernel (on CUDA: a Triton ``CompilationError`` per layer,
    then a fallback). With both switches on, the layers are compiled with transformers' modules
    (inductor fuses the norm, rotary and SwiGLU itself) and Liger keeps the fused linear
    cross-entropy, which runs at the head, outside the compiled layers. ``bench/gpu.sh`` measures
    both choices: "all on" (compiled layers + Liger's loss) against "compile off" (Liger's layers +
    Liger's loss)."""

    compiled_layers: bool  # torch.compile each decoder layer
    liger_layers: bool  # Liger's RMSNorm, RoPE and SwiGLU in the decoder layers
    liger_loss: bool  # Liger's fused linear cross-entropy at the head (no logits materialised)


def kernel_paths(m: ModelConfig) -> KernelPaths:
    return KernelPaths(
        compiled_layers=bool(m.compile),
        liger_layers=bool(m.liger_kernels) and not m.compile,
        liger_loss=bool(m.liger_kernels),
    )


def kernel_paths_line(m: ModelConfig) -> str | None:
    """The banner's line saying which path each part of the model takes (None: both switches off)."""
    paths = kernel_paths(m)
    if not (paths.compiled_layers or paths.liger_loss):
        return None
    if paths.compiled_layers:
        layers = "decoder layers compiled by torch.compile (transformers' RMSNorm, RoPE, SwiGLU fused by inductor"
        layers += "; Liger's are left out of the compiled layers)" if paths.liger_loss else ")"
    else:
        layers = "decoder layers eager with Liger's RMSNorm, RoPE and SwiGLU"
    loss = "Liger's fused linear cross-entropy, eager" if paths.liger_loss else "transformers' head and cross-entropy"
    return f"kernel paths: {layers}; loss: {loss}"


def recipe_problems(r: Recipe, spec: EngineSpec) -> list[Problem]:
    """Switch combinations that cannot work on the resolved engine ``spec``, whatever the machine."""
    p: list[Problem] = []
    m = r.model
    if m.compile and spec.module_hooks:
        # DeepSpeed runs its own hooks around every submodule (ZeRO-3 gathers parameters in them)
        # and has its own compile entry point; llmft does not compile layers underneath it.
        p.append(
            Problem(
                "model.compile",
                f"is not supported with distributed.engine={spec.name} ({spec.title}'s per-module ZeRO hooks "
                "would run inside the compiled layers)",
                "Set model.compile=false, or use distributed.engine=fsdp (sharded like ZeRO-3) or ddp.",
            )
        )
    if m.liger_kernels and spec.gathers_in_module_call and spec.shards_parameters(r):
        p.append(
            Problem(
                "model.liger_kernels",
                f"cannot run under {spec.title} {spec.sharded_title}: the fused linear cross-entropy reads "
                f"lm_head.weight directly, outside the module call in which {spec.sharded_title} gathers it",
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
    return p + tiled_mlp_problems(r, spec)


# torch's document-masked attention for packed rows (llmft.model.attention), a transformers attention name.
VARLEN_SDPA = "varlen_sdpa"


def chosen_attention(attn_implementation: str, packing: bool, flash: bool) -> str:
    """What ``model.attn_implementation`` runs: itself, or for ``auto``: flash_attention_2 where
    ``flash`` (flash-attn imports and CUDA is present), else varlen_sdpa for packed rows (no seq^2
    mask), else sdpa."""
    if attn_implementation != "auto":
        return attn_implementation
    if flash:
        return "flash_attention_2"
    return VARLEN_SDPA if packing else "sdpa"


# MLP linears of a Llama-style layer: what peft.dropout would randomise inside a tiled MLP.
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def tiled_mlp_problems(r: Recipe, spec: EngineSpec) -> list[Problem]:
    """DeepSpeed's TiledMLP (the tiling of the engines whose ``EngineSpec.tiled_mlp`` is "TiledMLP")
    recomputes each tile in backward without replaying dropout's random state; the per-tile
    checkpoints of DDP and FSDP2 replay it."""
    if not r.model.tiled_mlp or spec.tiled_mlp != "TiledMLP":
        return []
    targets = r.peft.target_modules
    names = list(MLP_LINEARS) if targets == "all-linear" else [str(t).split(".")[-1] for t in targets or ()]
    if r.peft.method != "none" and r.peft.dropout > 0 and set(names) & set(MLP_LINEARS):
        return [
            Problem(
                "peft.dropout",
                f"{r.peft.dropout:g} on MLP layers cannot be tiled on the {spec.name} engine: model.tiled_mlp "
                "(DeepSpeed's TiledMLP) recomputes each tile in backward without replaying dropout's random state, "
                "so the gradients would not be those of the forward",
                "Set peft.dropout=0, or model.tiled_mlp=false (DDP and FSDP2 tile with checkpoints that replay it).",
            )
        ]
    return []
