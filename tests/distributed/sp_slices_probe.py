"""Run under torchrun (2 ranks): llmft's sequence slices against DeepSpeed's ``UlyssesSPDataLoaderAdapter``.

Both ranks of the sequence group collate the same rows (what llmft's sampler gives a group).
The adapter gathers the group's batches and hands rank r, at micro-step 0, its shard of rank 0's
batch: with equal batches, that is exactly the slice ``llmft.data.sequence.sequence_slice`` cuts.
Packed rows (restarting position ids) and right-padded rows, of an even width (the adapter refuses
a width the group does not divide; llmft pads it). Prints ``SLICES_MATCH <cases>`` on rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmft.data.loader import collate
from llmft.data.sequence import sequence_slice
from llmft.job.dist import leave_process


def _rows(packed: bool) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (10, 7, 12):
        ids = torch.randint(3, 300, (n,), generator=g).tolist()
        labels = [-100] * (n // 2) + ids[n // 2 :]
        pos = (list(range(5)) + list(range(n - 5))) if packed else None
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def main() -> None:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    for packed in (True, False):
        batch = collate(_rows(packed), pad_id=0)
        if not packed:  # the adapter needs position ids; right-padded rows count from 0
            batch = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}
            del batch["attention_mask"]
        ours = sequence_slice(batch, rank, 2)
        adapter = UlyssesSPDataLoaderAdapter(
            [dict(batch)], sp_rank=rank, sp_group=group, sp_world_size=2, device=torch.device("cpu")
        )
        theirs = next(adapter)
        for key in ("input_ids", "position_ids", "shift_labels"):
            assert torch.equal(ours[key], theirs[key]), (packed, key, ours[key], theirs[key])
    dist.barrier()
    if rank == 0:
        print("SLICES_MATCH packed unpacked", flush=True)
    dist.destroy_process_group()
    leave_process(0)


if __name__ == "__main__":
    main()
