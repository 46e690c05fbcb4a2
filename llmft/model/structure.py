"""What a built model is made of: its parameter counts (4-bit and ZeRO-3 partitioned weights count
their logical elements), the one-line description a run prints, and its repeated decoder-layer
classes (what FSDP wraps one by one and ``torch.compile`` compiles one by one)."""

from __future__ import annotations

from typing import Callable

import torch


def logical_numel(p: torch.Tensor) -> int:
    """Elements the parameter stands for, not the elements of its storage."""
    if hasattr(p, "ds_numel"):  # ZeRO-3 partitioned: the local tensor is empty
        return int(p.ds_numel)
    if type(p).__name__ == "Params4bit" and getattr(p, "bnb_quantized", False):
        state = getattr(p, "quant_state", None)
        if state is not None:
            return int(state.shape.numel())
        return p.numel() * p.element_size() * 2  # two 4-bit values per byte of packed storage
    return p.numel()


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; 4-bit weights count their logical elements."""
    trainable = total = 0
    for p in model.parameters():
        n = logical_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def human_count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def describe(model: torch.nn.Module) -> str:
    """One line, e.g. ``trainable 1.2M / 8.0B (0.02%)``."""
    trainable, total = param_counts(model)
    share = 100.0 * trainable / total if total else 0.0
    return f"trainable {human_count(trainable)} / {human_count(total)} ({share:.2f}%)"


def decoder_layer_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The repeated block classes to wrap one by one for FSDP, in model order.

    transformers lists them in ``_no_split_modules``; models without that (or whose list
    names classes absent here) fall back to classes whose name ends in DecoderLayer.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    classes = _classes_where(model, lambda cls: cls.__name__ in names)
    return classes or _classes_where(model, lambda cls: cls.__name__.endswith("DecoderLayer"))


def _classes_where(model: torch.nn.Module, keep: Callable[[type], bool]) -> tuple[type, ...]:
    found: dict[type, None] = {}
    for module in model.modules():
        if keep(type(module)):
            found.setdefault(type(module))
    return tuple(found)
