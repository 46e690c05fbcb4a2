"""One rank of tests/gpu/test_long_context_varlen.py: DeepSpeed's Ulysses attention (UlyssesSPAttentionHF
around flash_attention_2) over a packed row, against the same model on the whole row in one process.

Run by torchrun with 2 ranks: each builds the same tiny bf16 Llama, computes the reference on the
whole packed row alone (plain flash_attention_2, varlen from the restarting position ids), then
registers Ulysses (sp = 2) and runs its half of the row. Labels are shifted before the row is cut
(the way ALST's data adapter does), so the two halves' token losses are the whole row's. Rank 0
writes what the test compares to ``argv[1]``: the largest logit and gradient differences.

One GPU: both ranks share it over gloo (NCCL refuses two ranks on one device); two or more:
one GPU a rank over NCCL. ``LLMFT_PROBE_CPU=1`` runs the same steps on CPU in fp32 with sdpa over
one unpacked sequence (Ulysses drops the mask, so sdpa cannot keep packed sequences apart): a check
of the probe itself where there is no GPU.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

SEGMENTS = [300, 200, 400, 124]  # a packed row of 1024 tokens; the third sequence crosses the cut at 512
CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,  # GQA: 2 KV heads over sp 2, one a rank
    intermediate_size=512,
    vocab_size=512,
    max_position_embeddings=2048,
)
ATTN = ("flash_attention_2", torch.bfloat16, SEGMENTS)


def main(out: str) -> None:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.data.pack import positions

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cpu = os.environ.get("LLMFT_PROBE_CPU") == "1"
    attn, dtype, segments = ("sdpa", torch.float32, [sum(SEGMENTS)]) if cpu else ATTN
    shared = cpu or torch.cuda.device_count() < world
    device = torch.device("cpu") if cpu else torch.device("cuda", 0 if shared else rank)
    if not cpu:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="gloo" if shared else "nccl")

    torch.manual_seed(0)
    config = AutoConfig.for_model(**CONFIG)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    model.to(device).train()
    seq = sum(segments)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=gen).to(device)
    pos = torch.from_numpy(positions(torch.tensor(segments).numpy()))[None].to(device)
    labels = ids.clone()
    starts = torch.tensor([0, *segments[:-1]]).cumsum(0)
    labels[0, starts] = -100  # a sequence's first token is never predicted from the previous one
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    count = int((shifted != -100).sum())

    # the reference: the whole row in this process
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    F.cross_entropy(logits[0], shifted[0], ignore_index=-100, reduction="sum").div(count).backward()
    want_logits = logits.detach()
    want_grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # Ulysses sp = world: this rank's half of the row
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, attn, sequence_parallel_size=world, micro_batch_size=1, seq_length_is_variable=True
    )
    group = mpu.get_sequence_parallel_group()
    part = seq // world
    mine = slice(rank * part, (rank + 1) * part)
    logits = model(input_ids=ids[:, mine], position_ids=pos[:, mine], use_cache=False).logits.float()
    F.cross_entropy(logits[0], shifted[0, mine], ignore_index=-100, reduction="sum").div(count).backward()
    pieces = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(pieces, logits.detach().contiguous(), group=group)
    got_logits = torch.cat(pieces, dim=1)
    worst = {}
    for n, p in model.named_parameters():
        grad = p.grad.detach().float().contiguous()
        torch.distributed.all_reduce(grad, group=group)  # each half's share of the row's gradient
        worst[n] = float((grad - want_grads[n]).norm() / want_grads[n].norm().clamp_min(1e-12))
    if rank == 0:
        scale = float(want_logits.abs().max())
        result = {
            "logits_rel": float((got_logits - want_logits).abs().max()) / scale,
            "grad_rel": max(worst.values()),
            "worst_grad": max(worst, key=worst.get),
            "backend": "cpu" if cpu else ("gloo, one GPU" if shared else "nccl"),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from llmft.job.dist import leave_process

    main(sys.argv[1])
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)
