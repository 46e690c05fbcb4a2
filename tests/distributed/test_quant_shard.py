"""Each rank quantizes only its part of a 4-bit weight (llmft.model.quant_shard, docs/design.md G6):
the parts put together, and every rank's statistics, equal bitsandbytes quantizing the whole
weight, to the bit, for uneven splits whose boundaries fall inside NF4 blocks and between rows.

Three real gloo processes (a file store), each calling ``quantize_part`` for its range, as the
FSDP2 (rows of the packed tensor, ``torch.chunk`` sizes) and ZeRO-3 (flat, ``ceil(n / world)``)
layouts split it, including a rank with nothing to hold.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed  # three gloo processes

CASES = [  # (out, in), storage, compress_statistics, blocksize
    ((37, 50), torch.uint8, True, 64),  # a partial last block
    ((37, 56), torch.float32, False, 64),
    ((64, 96), torch.bfloat16, True, 128),
    ((4, 8), torch.float32, True, 64),  # 4 storage elements on 3 ranks: the last one holds none
    ((300, 64), torch.float32, True, 64),  # more than 256 blocks: double quantization over several
]


def _ranges(n: int, world: int, layout: str) -> list[tuple[int, int]]:
    size = -(-n // world)
    if layout == "zero3":
        return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]
    chunks = torch.arange(n).chunk(world)  # FSDP2 Shard(0): torch.chunk sizes, trailing ranks may be empty
    out = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    return out + [(n, n)] * (world - len(out))


def _worker(rank: int, world: int, store: str, results) -> None:
    import bitsandbytes.functional as bnb_f
    import torch.distributed as dist

    from llmft.job.dist import leave_process
    from llmft.model.quant_shard import quantize_part, values_per_element

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    out = []
    for (o, i), storage, compress, blocksize in CASES:
        weight = torch.randn(o, i)
        how = {"blocksize": blocksize, "compress_statistics": compress, "quant_type": "nf4", "quant_storage": storage}
        whole, state = bnb_f.quantize_4bit(weight, **how)
        n = -(-weight.numel() // values_per_element(storage))
        assert whole.shape[0] == n
        for layout in ("fsdp", "zero3"):
            start, end = _ranges(n, world, layout)[rank]
            part, got = quantize_part(
                lambda a, b, w=weight: w.reshape(-1)[a:b],
                weight.shape,
                how,
                torch.float32,
                start,
                end,
                device=torch.device("cpu"),
                group=dist.group.WORLD,
            )
            same_bytes = torch.equal(part.view(torch.uint8), whole.reshape(-1)[start:end].view(torch.uint8))
            a, b = got.as_dict(packed=True), state.as_dict(packed=True)
            same_state = a.keys() == b.keys() and all(
                torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
            )
            out.append((layout, o, i, str(storage), end - start, same_bytes, same_state))
    results[rank] = out
    dist.destroy_process_group()
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)


def test_each_rank_quantizes_only_its_part_and_matches_the_whole_weight(tmp_path):
    import bitsandbytes  # noqa: F401  (a core dependency: missing is a failure, not a skip)

    world = 3
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, str(tmp_path / "store"), results), nprocs=world, join=True)
        results = dict(results)
    held = {}
    for rank, rows in results.items():
        for layout, o, i, storage, count, same_bytes, same_state in rows:
            assert same_bytes and same_state, (rank, layout, o, i, storage)
            held.setdefault((layout, o, i, storage), []).append(count)
    assert any(0 in counts for counts in held.values())  # a rank with nothing to hold still takes part
    assert all(len(c) == world for c in held.values())
