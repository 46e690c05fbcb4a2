"""Document-masked attention from torch itself for packed rows: ``model.attn_implementation``
``varlen_sdpa``, and what ``auto`` picks.

A packed row holds several examples, their ``position_ids`` restarting at 0 for each, and no
attention mask (``llmft.data.pack``). transformers' sdpa path keeps the examples apart with a
block-diagonal ``rows x 1 x T x T`` boolean mask: its memory grows with the square of the row's
length (16 GiB for one row of 128K tokens), and on CUDA a mask keeps sdpa off its flash kernel.
Flash attention's varlen kernel needs none (``flash_attention_2``, a separate package that pip
cannot install for every torch and CUDA). FlexAttention's block masks are O((T/128)^2) indices,
but torch has no FlexAttention backward on CPU.

``varlen_sdpa`` is registered in transformers' attention registry under that name. It runs
``torch.nn.functional.scaled_dot_product_attention`` causally (``is_causal=True``, no mask) on each
example of each row in turn, the examples' boundaries being the ``cu_seq_lens`` that
``llmft.model.kernels.pass_packed_boundaries`` computes once per forward from the position ids
(the rule of flash attention's varlen path). Without a mask sdpa runs a fused kernel (on CPU
``_scaled_dot_product_flash_attention_for_cpu``; on CUDA flash or memory-efficient attention) that
holds O(T) memory, forward and backward. The cost is one sdpa call per example per layer.

Rows with a padding mask (unpacked batches, generation) take sdpa's own path with its mask.

Under ``model.compile`` (regional compilation of each decoder layer) the function runs eagerly
between the layer's compiled graphs (``torch.compiler.disable``): the number and lengths of the
examples change from row to row, and compiling them would recompile for every new length.

``auto`` (``choose``): ``flash_attention_2`` where flash-attn imports and CUDA is present; else
``varlen_sdpa`` for packed rows; else ``sdpa``. The recipe-level rule (no torch) is
``llmft.plan.kernels.chosen_attention``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from llmft.model.kernels import varlen_kwargs
from llmft.plan.kernels import VARLEN_SDPA, chosen_attention

_bounds_cache: list[Any] = [None, None]  # [cu_seq_lens tensor, its host list]: one sync per forward, not per layer


def choose(attn_implementation: str, packing: bool) -> str:
    """The attention implementation a run uses on this machine (``auto`` resolved; module docstring)."""
    flash = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    name = chosen_attention(attn_implementation, packing, flash)
    if name == VARLEN_SDPA:
        register()
    return name


def register() -> None:
    """Make ``varlen_sdpa`` a name transformers accepts (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)


def varlen_sdpa_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for rows without a padding mask (causal within each example: the attention reads
    the boundaries); sdpa's mask where a padding mask is given."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


@torch.compiler.disable  # eager inside a compiled layer: the loop's bounds are data (module docstring)
def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``(rows, heads, T, D)``, ``key`` and
    ``value`` ``(rows, kv_heads, T, D)``; returns ``(rows, T, heads, D)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    whole = query.shape[2] == key.shape[2]  # no KV cache ahead of these queries
    if cu is None and attention_mask is None and whole and kwargs.get("position_ids") is not None:
        # the pre-hook's rule, when it did not run
        cu = varlen_kwargs(kwargs["position_ids"].expand(query.shape[0], -1))["cu_seq_lens_q"]
    if cu is None or attention_mask is not None or not whole or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows, heads, seq, dim = query.shape
    groups = heads // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key  # transformers' repeat_kv order
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    p = dropout if module.training else 0.0
    q, k, v = (t.transpose(1, 2).reshape(rows * seq, heads, -1) for t in (query, key, value))
    pieces = []
    for start, end in _bounds(cu):
        one = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        pieces.append(F.scaled_dot_product_attention(*one, dropout_p=p, is_causal=True, scale=scaling)[0])
    out = torch.cat(pieces, dim=1).transpose(0, 1)  # (rows * T, heads, D)
    return out.reshape(rows, seq, heads, -1), None


def _bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    if _bounds_cache[0] is not cu:
        points = cu.tolist()
        _bounds_cache[:] = [cu, list(zip(points[:-1], points[1:], strict=True))]
    return _bounds_cache[1]
