"""One process, one device. Also the building blocks DDP reuses: model preparation and plain
(unsharded) save/load of model and optimizer state."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import ContextManager

import torch

from llmft.dist import DistEnv
from llmft.engines import autocast_for
from llmft.optim import build_optimizer, scaled_lr
from llmft.plan.batch import BatchPlan
from llmft.recipe.schema import Recipe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"


def compute_dtype(recipe: Recipe) -> torch.dtype:
    return DTYPES[recipe.model.dtype]


def upcast_trainable(model: torch.nn.Module) -> None:
    """Mixed precision: trainable weights (and so their grads and optimizer state) live in fp32,
    frozen weights stay in the compute dtype; autocast runs the matmuls in the compute dtype."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def prepare_model(recipe: Recipe, tokenizer, device: torch.device, **kwargs) -> torch.nn.Module:
    from llmft import kernels
    from llmft.model import build_model

    kernels.check_available(recipe.model)  # issue 15 (llmft/kernels.py): before any weight is loaded
    model = build_model(recipe, tokenizer, device=str(device), **kwargs)
    upcast_trainable(model)
    kernels.apply(model, recipe.model)  # issue 15: Liger, flash-attention boundaries, compile
    return model.to(device) if recipe.model.quantization is None else model


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def save_plain(model: torch.nn.Module, optimizer, directory: Path, *, save_optimizer: bool) -> None:
    """save_pretrained (PEFT adapter dir, or full HF model dir) + optimizer state; rank 0 only."""
    model.save_pretrained(directory / MODEL_DIR, safe_serialization=True)
    if save_optimizer:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)


def load_model_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Inverse of save_pretrained into an already built model, without touching the base weights."""
    from safetensors.torch import load_file

    if is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(model_dir / "adapter_model.safetensors"))
        unexpected = getattr(result, "unexpected_keys", [])
        assert not unexpected, f"adapter checkpoint has unexpected keys: {unexpected[:5]}"
        return
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(model_dir / name))
    missing, unexpected = model.load_state_dict(state, strict=False)
    check_loaded_keys(model, missing, unexpected)


def check_loaded_keys(model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """After a non-strict load of a whole model: no stray names, and only weights tied to another
    one (which save_pretrained and zero_to_fp32 drop) may be absent."""
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    assert not unexpected, f"checkpoint has unexpected keys: {unexpected[:5]}"
    assert set(missing) <= tied or all("lm_head" in k for k in missing), f"checkpoint misses {missing[:5]}"


def load_optimizer_state(optimizer, directory: Path, device: torch.device) -> None:
    state = torch.load(directory / OPTIMIZER_FILE, map_location=device, weights_only=True)
    optimizer.load_state_dict(state)


class SingleEngine:
    name = "single"
    grad_scale = 1.0

    def __init__(self, recipe: Recipe, env: DistEnv, plan: BatchPlan, tokenizer, total_steps: int) -> None:
        self.device = env.device
        self.dtype = compute_dtype(recipe)
        self.model = prepare_model(recipe, tokenizer, self.device)
        self.optimizer = build_optimizer(self.model, recipe.optim, scaled_lr(recipe.optim, plan.global_batch_size))
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    def micro_step(self, boundary: bool) -> ContextManager:
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        return autocast_for(self.dtype, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm: float | None) -> float:
        return clip_and_step(self.model, self.optimizer, self.scaler, max_grad_norm)

    def unwrap(self) -> torch.nn.Module:
        return self.model

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        save_plain(self.model, self.optimizer, directory, save_optimizer=save_optimizer)

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        load_model_weights(self.model, directory / MODEL_DIR)
        if load_optimizer:
            load_optimizer_state(self.optimizer, directory, self.device)


def clip_and_step(model: torch.nn.Module, optimizer, scaler, max_grad_norm: float | None) -> float:
    """fp16: unscale once, before clipping. The norm is measured even when clipping is off."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
