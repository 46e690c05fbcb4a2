"""Ulysses sequence parallelism: attention over whole sequences, each rank holding a slice of them.

DeepSpeed's ``UlyssesSPAttentionHF`` (ALST, ``deepspeed/runtime/sequence_parallel/ulysses_sp.py``)
does the work: before attention an all-to-all within the sequence group turns each rank's
``(slice of tokens, all heads)`` into ``(all tokens, 1/N of the heads)``, the model's own attention
kernel runs on that, and a second all-to-all turns it back. KV heads fewer than N are replicated.
It replaces the model's attention function in transformers' registry (``_attn_implementation``
keeps its name, so every branch transformers takes for that kernel still runs).

What llmft adds around it (``install``):

- the micro-batch's rows are counted at each call, not fixed at install: a preference batch has
  two rows per pair and its reference pass runs through the same attention;
- the attention mask transformers built for the local slice is dropped (DeepSpeed does too) and
  rebuilt from the gathered whole-row position ids: a packed row gets its block-diagonal causal
  mask under sdpa (DeepSpeed's wrapper would let its sequences attend to each other), and the
  varlen boundaries (``model.kernels.varlen_kwargs``) of flash attention and ``varlen_sdpa``
  (``llmft.model.attention``) are recomputed for the whole row instead of the slice.

The groups are the layout's: the ``sp`` dimension of the run's mesh (``llmft.job.dist.run_mesh``, a
view of the one world mesh; ranks ``[g*N, (g+1)*N)`` share sequence group ``g``, the same split as
``ParallelLayout.dp_rank``).
DeepSpeed's engine also wants its own bookkeeping of them (``deepspeed_mpu``, the ``mpu`` that
``deepspeed.initialize`` takes), checked to hold the same ranks.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch

from llmft.model.kernels import VARLEN_ATTENTION, varlen_kwargs

_INSTALLED: dict[str, Any] = {}  # attn implementation -> the Ulysses attention installed for it (one per process)


def deepspeed_mpu(group: Any) -> ModuleType:
    """DeepSpeed's sequence-parallel bookkeeping (``parallel_state_sp``), the ``mpu`` that
    ``deepspeed.initialize`` takes, checked to hold the same ranks as ``group`` (the layout's)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    _deepspeed_comm()
    size = torch.distributed.get_world_size(group)
    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=size)
    theirs = torch.distributed.get_process_group_ranks(mpu.get_sequence_parallel_group())
    ours = torch.distributed.get_process_group_ranks(group)
    assert theirs == ours, f"DeepSpeed's sequence group {theirs} is not the layout's {ours}"
    return mpu


def _deepspeed_comm() -> None:
    """DeepSpeed's comm layer over the process group llmft created (its all-to-alls run there)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


def install(model: torch.nn.Module, group: Any) -> None:
    """Run ``model``'s attention as Ulysses over ``group``, this rank's sequence group (the run
    mesh's ``sp`` dimension, ``llmft.job.dist.sequence_group``)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _deepspeed_comm()
    config = model.config.get_text_config()
    impl = config._attn_implementation
    if impl in _INSTALLED:
        return
    assert impl in ("sdpa", "flash_attention_2", "varlen_sdpa"), (
        "resolve refuses other attention with sequence parallelism"
    )
    uattn = UlyssesSPAttentionHF(
        attn=_whole_row_attention(ALL_ATTENTION_FUNCTIONS[impl], impl),
        batch_size=1,
        attn_head_count=config.num_attention_heads,
        attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        kv_head_count=config.num_key_value_heads,
        num_hidden_layers=config.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
    )
    uattn.core_attn_implementation = impl

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        _set_rows(uattn, query.shape[0])
        return uattn(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = attention
    _INSTALLED[impl] = uattn


def _set_rows(uattn: Any, rows: int) -> None:
    """The shapes DeepSpeed checks and reshapes to, for a micro-batch of ``rows`` rows."""
    if uattn.batch_size == rows:
        return
    uattn.batch_size = rows
    for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
        shape = list(getattr(uattn, name))
        shape[1] = rows
        setattr(uattn, name, torch.Size(shape))


def _whole_row_attention(core: Callable, impl: str) -> Callable:
    """The model's attention kernel, given what the whole rows need (module docstring)."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        pos = kwargs["position_ids"]  # gathered by DeepSpeed: whole rows
        if kwargs.get("cu_seq_lens_q") is not None or (impl in VARLEN_ATTENTION and _packed(pos)):
            kwargs.update(varlen_kwargs(pos))
        elif attention_mask is None and _packed(pos):
            attention_mask = block_causal_mask(pos)
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def _packed(position_ids: torch.Tensor) -> bool:
    """A row holds more than one sequence: the positions restart somewhere after its start."""
    return bool((position_ids[:, 1:] - position_ids[:, :-1] != 1).any())


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, 1, T, T)`` boolean mask (True: attend): causal within each sequence of a packed
    row, a sequence starting wherever the position does not grow by one (``varlen_kwargs``' rule)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    seq = starts.cumsum(dim=1)
    same = seq[:, :, None] == seq[:, None, :]
    width = position_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]
