"""Quantize only this rank's part of a 4-bit weight, bit-identical to bitsandbytes quantizing it whole.

bitsandbytes' NF4/FP4 quantization is blockwise: each block of ``blocksize`` values is packed
from those values and the block's absmax alone. So a rank that keeps the packed bytes
``[start, end)`` of a weight (FSDP2: its rows of the packed ``(n, 1)`` tensor; ZeRO-3: its flat
partition) reads only the blocks that cover them, quantizes those, and cuts its bytes out. The
statistics (one absmax per block, about 1/64 of the weight, compressed with double quantization
over the whole vector) are kept whole on every rank, as bitsandbytes needs them: each rank
contributes the absmax of its blocks to an all-gather over the ranks that share the weight, and
every rank then builds the same ``QuantState`` as ``quantize_4bit`` does (same offset, same
second-level quantization). A rank reads and quantizes about 1/world of every weight.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def values_per_element(storage: torch.dtype) -> int:
    """How many 4-bit values one element of the packed storage dtype holds."""
    return 2 * torch.empty(0, dtype=storage).element_size()


def quantize_part(
    read: Callable[[int, int], torch.Tensor],
    shape: torch.Size,
    how: dict[str, Any],
    dtype: torch.dtype,
    start: int,
    end: int,
    *,
    device: torch.device,
    group: Any = None,
) -> tuple[torch.Tensor, Any]:
    """The packed storage elements ``[start, end)`` of the weight of ``shape`` (``read(a, b)``:
    its flattened values ``[a, b)``) and its whole ``QuantState``, as ``quantize_4bit`` gives them
    for the full weight in ``dtype``. ``group``: the ranks that share the weight (None: this rank
    holds all of it); every rank of it must call this for the same weight."""
    import bitsandbytes.functional as bnb_f  # optional (the qlora extra): only 4-bit weights get here

    blocksize, storage, quant_type = how["blocksize"], how["quant_storage"], how["quant_type"]
    per = values_per_element(storage)
    numel = shape.numel()
    nblocks = -(-numel // blocksize)
    v0, v1 = min(start * per, numel), min(end * per, numel)
    b0, b1 = (v0 // blocksize, -(-v1 // blocksize)) if v1 > v0 else (0, 0)
    if b1 > b0:
        values = read(b0 * blocksize, min(b1 * blocksize, numel)).to(device=device, dtype=dtype).contiguous()
        packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(values, blocksize, quant_type, storage)
        del values
        first = b0 * blocksize // per  # the storage element the quantized blocks start at
        part = packed.reshape(-1)[start - first : end - first]
    else:
        part = torch.empty(0, dtype=storage, device=device)
        absmax = torch.empty(0, dtype=torch.float32, device=device)
    full = _whole_absmax(absmax.float(), b0, b1, nblocks, group)
    code = bnb_f.get_4bit_type(quant_type, device=full.device)
    if how["compress_statistics"]:
        offset = full.mean()
        qabsmax, state2 = bnb_f.quantize_blockwise(full - offset, blocksize=256)
        state = bnb_f.QuantState(
            absmax=qabsmax,
            shape=shape,
            dtype=dtype,
            blocksize=blocksize,
            code=code,
            quant_type=quant_type,
            offset=offset,
            state2=state2,
        )
    else:
        state = bnb_f.QuantState(
            absmax=full, shape=shape, dtype=dtype, blocksize=blocksize, code=code, quant_type=quant_type
        )
    return part, state


def _whole_absmax(absmax: torch.Tensor, b0: int, b1: int, nblocks: int, group: Any) -> torch.Tensor:
    """Every block's absmax, from each rank's blocks ``[b0, b1)`` (neighbours may share a block:
    both computed it from the same values)."""
    if group is None or dist.get_world_size(group) == 1:
        assert (b0, b1) == (0, nblocks), "one rank holding the weight quantizes all of its blocks"
        return absmax
    world = dist.get_world_size(group)
    spans = [torch.zeros(2, dtype=torch.int64, device=absmax.device) for _ in range(world)]
    dist.all_gather(spans, torch.tensor([b0, b1], dtype=torch.int64, device=absmax.device), group=group)
    spans_ = [(int(s[0]), int(s[1])) for s in spans]
    longest = max(b - a for a, b in spans_)
    padded = torch.zeros(longest, dtype=absmax.dtype, device=absmax.device)
    padded[: absmax.numel()] = absmax
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    full = torch.full((nblocks,), float("nan"), dtype=absmax.dtype, device=absmax.device)
    for (a, b), part in zip(spans_, parts, strict=True):
        full[a:b] = part[: b - a]
    assert not full.isnan().any(), "every block of the weight is held by some rank"
    return full
