"""The dtypes of a run: the recipe's names for them, the compute dtype, and mixed precision's fp32
trainable weights (``upcast_trainable``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(recipe: Recipe) -> torch.dtype:
    return DTYPES[recipe.model.dtype]


def upcast_trainable(model: torch.nn.Module) -> None:
    """Mixed precision: trainable weights (and so their grads and optimizer state) live in fp32,
    frozen weights stay in the compute dtype; autocast runs the matmuls in the compute dtype."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
