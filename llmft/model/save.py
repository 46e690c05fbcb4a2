"""Saving a model outside a checkpoint's sharded state: ``save_model_dir`` (a step's ``model/`` and
``tokenizer/``, what ``save_pretrained`` writes) and ``save_base_model``, the frozen base of a
(PEFT, maybe quantized) model as a plain Hugging Face model dir: adapters left out, 4-bit and 8-bit
weights dequantized, the config made the unquantized inference one (``plain_config``). Training
writes the base of a fresh ``model.config`` model with it once (``checkpoints/base_model/``), and
``llmft export`` (``llmft.export.export``) writes such dirs with it too: training does not import the exporter.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors.torch import save_file

from llmft.checkpoint.layout import MODEL_DIR, TOKENIZER_DIR
from llmft.errors import Problem, UserError
from llmft.model.adapters import base_key

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out: Path, *, state_dict: dict | None = None) -> Path:
    """Write ``out/model`` (``save_pretrained``: adapter dir or full model dir) and ``out/tokenizer``.

    ``state_dict``: a consolidated state dict from a sharding engine (gathered on this rank).
    """
    out = Path(out)
    model_dir = out / MODEL_DIR
    model.save_pretrained(model_dir, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / TOKENIZER_DIR)
    return model_dir


def save_base_model(model: torch.nn.Module, out: Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write the frozen base of a (PEFT) model as a HF model dir that ``from_pretrained`` loads.

    Adapter weights are left out; quantized weights are dequantized, so an adapter
    trained with QLoRA sees, on this base, the weights it was trained against. Written
    into a temporary sibling and renamed, so ``out`` is complete or absent. Call it on
    an unsharded model (single process, or DDP rank 0).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = dtype or _config_dtype(base.config)
    state = base_state_dict(base, dtype)
    config = plain_config(base.config, dtype)
    _check_keys(state, config, type(base))

    out = Path(out)
    with staged(out) as tmp:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out


def base_state_dict(base: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's weights under their original names, dequantized, on CPU, in ``dtype``."""
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # tied weights are one tensor under two names: keep the first
    for module_name, module in base.named_modules():
        persistent = [
            (n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set
        ]
        for name, tensor in [*module.named_parameters(recurse=False), *persistent]:
            # the frozen base: adapter weights and trained modules_to_save copies are not part of it
            key = base_key(f"{module_name}.{name}" if module_name else name, trained_copies=False)
            if key is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            state[key] = dequantized(tensor).to("cpu", dtype).contiguous()
    return state


def dequantized(t: torch.Tensor) -> torch.Tensor:
    kind = type(t).__name__
    if kind == "Params4bit" and getattr(t, "bnb_quantized", False):
        import bitsandbytes.functional as bnb_f  # optional (the qlora extra): only a 4-bit weight gets here

        return bnb_f.dequantize_4bit(t.data, t.quant_state)
    if kind == "Int8Params" and getattr(t, "SCB", None) is not None:
        import bitsandbytes.functional as bnb_f  # optional (the qlora extra): only an 8-bit weight gets here

        return bnb_f.int8_vectorwise_dequant(t.data, t.SCB)
    return t.detach()


def plain_config(config: PretrainedConfig, dtype: torch.dtype) -> PretrainedConfig:
    """The config of the unquantized model in ``dtype``, ready for inference (KV cache on)."""
    config = copy.deepcopy(config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    config.use_cache = True
    return config


def _check_keys(state: dict[str, torch.Tensor], config: PretrainedConfig, model_class: type) -> None:
    """Our renaming of PEFT's parameter paths must give exactly the plain model's names (of the
    base's own class: a causal LM, or a sequence classifier with its score head)."""
    with torch.device("meta"):
        expected_model = model_class(config)
    expected = set(expected_model.state_dict())
    unexpected = sorted(set(state) - expected)
    missing = expected - set(state)
    tied = set(getattr(expected_model, "_tied_weights_keys", None) or ())  # a dict (v5) or a list: the names
    assert not unexpected, f"base weights with names the model does not have: {unexpected[:5]}"
    assert missing <= tied, f"base weights missing: {sorted(missing)[:5]}"


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


STAGING_MARKER = ".llmft-staging"  # inside a folder ``staged`` is writing: llmft's own, removable


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Build ``out`` in a temporary sibling and rename it into place: complete or absent.

    The sibling ``.tmp-<name>`` carries a marker file from its first moment, so a killed write's
    leftover is recognised and removed, and a folder of the user's that happens to bear that
    name is refused, never deleted."""
    tmp = out.with_name(f".tmp-{out.name}")
    if tmp.is_symlink() or tmp.exists():
        if not (tmp.is_dir() and not tmp.is_symlink() and (tmp / STAGING_MARKER).is_file()):
            raise UserError(
                Problem(
                    str(tmp),
                    f"is in the way: llmft stages {out.name} there before renaming it into place, and this "
                    "is not a folder llmft left (it has no staging marker)",
                    "Move it away, or choose another --out.",
                )
            )
        shutil.rmtree(tmp)  # a killed write's leftover: llmft's own
    tmp.mkdir(parents=True)
    (tmp / STAGING_MARKER).touch()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / STAGING_MARKER).unlink()
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(tmp, out)
