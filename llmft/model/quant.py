"""Quantization (QLoRA's base): ``model.quantization`` as a ``BitsAndBytesConfig``, the k-bit
preparation of a quantized model for training (a frozen base that stays in its storage and
compute dtypes: no fp32 copies of frozen weights), the empty packed 4-bit layout a meta-device build starts from, and
the one layout bitsandbytes must keep for training. Each rank's part of a 4-bit weight is quantized
in ``quant_shard``."""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from transformers import BitsAndBytesConfig

from llmft.model.precision import DTYPES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from llmft.recipe.schema import QuantizationConfig


STORAGE_DTYPES = {**DTYPES, "uint8": torch.uint8}


def import_bitsandbytes(hub_kernels: bool) -> ModuleType:
    """bitsandbytes, imported so that it fetches nothing from the Hub unless ``model.hub_kernels``.

    bitsandbytes 0.50 asks the Hub for ``kernels-community/quantization-bitsandbytes`` (its CPU
    4-bit matmul) when it is imported on a CPU with AVX512-BF16 and the ``kernels`` package is
    installed. That is code fetched at import that no recipe named (docs/offline.md), so for its
    first import ``kernels.get_kernel`` refuses; bitsandbytes then uses its own kernel, as it does
    offline. Imported once per process: every later import (transformers' quantizer too) gets it."""
    if hub_kernels or "bitsandbytes" in sys.modules:
        return importlib.import_module("bitsandbytes")
    try:
        import kernels
    except ImportError:  # nothing to fetch with
        return importlib.import_module("bitsandbytes")

    def refused(repo_id: str, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{repo_id} is not fetched: model.hub_kernels is false")

    original, kernels.get_kernel = kernels.get_kernel, refused
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "failed to load" warning: the refusal above, not a fault
    try:
        return importlib.import_module("bitsandbytes")
    finally:
        kernels.get_kernel = original
        quiet.setLevel(level)


def quantization_config(
    q: QuantizationConfig | None, compute_dtype: torch.dtype, *, storage: str | None = None
) -> BitsAndBytesConfig | None:
    """``model.quantization`` as transformers' ``BitsAndBytesConfig`` (None when off)."""
    if q is None:
        return None
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    # Sharding engines flatten parameters of one dtype; packed uint8 next to bf16 norms would not
    # shard, so the plan stores the packed bytes viewed as the compute dtype there.
    storage = storage or q.quant_storage or "uint8"
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=STORAGE_DTYPES[storage],
    )


def prepare_kbit(model: PreTrainedModel, checkpointing: dict[str, Any] | None) -> None:
    """Freeze the quantized base (and checkpoint activations with ``checkpointing``'s kwargs; None: off).

    Unlike PEFT's ``prepare_model_for_kbit_training``, the unquantized weights (norms, embeddings,
    head) are not cast to fp32: they are frozen, so an fp32 copy buys no update precision and costs
    2 bytes per parameter more (2 GiB on Llama-3-8B, whose embedding and head hold 1B parameters).
    Precision goes where it matters: the trained adapters are fp32 (``upcast_trainable``), the
    norms compute in fp32 inside transformers' RMSNorm, and the loss is fp32 (``llmft.model.loss``).
    Every frozen tensor then has one dtype, which the sharding engines need anyway.
    """
    keep_4bit_layout(model)
    model.requires_grad_(False)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)


def quantized_skeleton(model: PreTrainedModel, quant: BitsAndBytesConfig, dtype: torch.dtype) -> None:
    """A 4-bit model's modules without weights, as ``from_pretrained`` lays them out before loading.

    transformers' own quantizer swaps the linear layers for bitsandbytes' ``Linear4bit`` and marks
    the model quantized (what PEFT checks); each weight is then replaced by an empty (meta) packed
    tensor of the shape and storage dtype ``quantize_4bit`` gives it, so that a sharding engine splits
    the packed bytes exactly as it splits those of a model built whole. The engine fills them
    (``llmft.model.meta``); the quantization statistics live on each module (``quant_state``),
    where bitsandbytes looks for them once FSDP has swapped the parameter.
    """
    import bitsandbytes as bnb  # optional (the qlora extra): imported only when a model is quantized
    from transformers.quantizers import AutoHfQuantizer  # imports every quantization backend (seconds)

    quantizer = AutoHfQuantizer.from_config(quant, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            values_per_element = 2 * torch.empty(0, dtype=w.quant_storage).element_size()
            packed = torch.empty(((w.numel() + 1) // values_per_element, 1), dtype=w.quant_storage, device="meta")
            module.weight = bnb.nn.Params4bit(
                packed,
                requires_grad=False,
                blocksize=w.blocksize,
                compress_statistics=w.compress_statistics,
                quant_type=w.quant_type,
                quant_storage=w.quant_storage,
                module=module,
                bnb_quantized=True,
            )
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def keep_4bit_layout(model: torch.nn.Module) -> None:
    """Keep every 4-bit weight in the layout that training differentiates through.

    On a CPU with AVX512-BF16, bitsandbytes (>= 0.48) repacks a Linear4bit's weight in place
    the first time the layer runs in eval mode without grad, which is what evaluation does,
    and from then on computes that layer with ``gemv_4bit``: an inference kernel with no
    autograd and a bf16 accumulation. Training after the first eval would then lose the
    gradient through every quantized layer (the adapters of earlier layers get none through
    the base path) and evaluate with other numerics than it trains with.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
