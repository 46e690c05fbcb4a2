"""Optimizer, learning-rate schedule and the learning-rate scaling rule."""

from __future__ import annotations

import logging
import math

import torch

from llmft.model.quant import import_bitsandbytes
from llmft.recipe.schema import OptimConfig

log = logging.getLogger("llmft")


def scaled_lr(cfg: OptimConfig, global_batch_size: int) -> float:
    """optim.lr was tuned at lr_scaling_base_batch; scale it to the real global batch."""
    ratio = global_batch_size / cfg.lr_scaling_base_batch
    if cfg.lr_scaling == "linear":
        return cfg.lr * ratio
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm weights (1-D) get no weight decay."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def adamw_implementation(groups: list[dict]) -> dict[str, bool | None]:
    """torch AdamW's kernel choice: ``fused`` when every parameter is a float tensor on CUDA.

    The fused kernel updates all parameters of a group in a few launches and reads each state
    tensor once; foreach=None (torch's own pick: the multi-tensor kernels on CUDA, the per-tensor
    loop on CPU) stays the path everywhere else, so CPU runs and their checkpoints are unchanged.
    Both compute the same AdamW update (tests/unit/test_kernels.py compares them).
    """
    params = [p for g in groups for p in g["params"]]
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": None}


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps, **adamw_implementation(groups))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum)
    bnb = import_bitsandbytes(hub_kernels=False)  # only for the bitsandbytes optimizers; no Hub fetch

    cls = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw": bnb.optim.PagedAdamW,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
    }[cfg.name]
    return cls(groups, lr=lr, betas=betas, eps=cfg.eps)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr before optimizer step ``step + 1`` (``step`` optimizer steps done)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.scheduler == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.scheduler == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Stepped once per optimizer step (never per micro-step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
