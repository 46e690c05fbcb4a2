"""Attention memory of one packed row, by row length: sdpa (transformers' block-diagonal mask)
against varlen_sdpa (``model.attn_implementation: auto`` for packed rows without flash-attn).

Each case is a fresh process: a 1-layer Llama (hidden 64, 4 query heads, 2 KV heads, vocab 320,
fp32, CPU) runs one forward and backward of one packed row of T tokens (8 examples of T/8 tokens
by default,
positions restarting at 0 for each, no attention mask), as the training loop calls it. It reports

- ``peak MiB``: the growth of the process's peak resident set (``ru_maxrss``) over the step,
  after a warm-up step at 256 tokens, so libraries and the model are not counted;
- ``largest MiB``: the biggest single tensor any op produced in the step (a TorchDispatchMode);
  a T x T mask or score matrix shows here;
- ``seconds``: the step's wall time (2 shared CPU cores: indicative only).

    python bench/long_attention.py                       # T = 2048, 4096, 8192
    python bench/long_attention.py --seqs 2048 4096 8192 16384
    python bench/long_attention.py --seqs 4096 --examples 128   # many short examples a row
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

ATTENTIONS = ("sdpa", "varlen_sdpa")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--examples", type=int, default=8, help="examples per row (equal lengths)")
    p.add_argument("--one", nargs=2, metavar=("ATTN", "SEQ"), help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.examples)))
        return
    print("| attention | T | examples | peak MiB | largest MiB | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for attn in ATTENTIONS:
        for seq in args.seqs:
            out = subprocess.run(
                [sys.executable, __file__, "--examples", str(args.examples), "--one", attn, str(seq)],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            row = f"{r['peak_mib']:.1f} | {r['largest_mib']:.1f} | {r['seconds']:.2f}"
            print(f"| {attn} | {seq} | {args.examples} | {row} |")


def measure(attn: str, seq: int, examples: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmft.model import attention, kernels

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.nbytes = max(self.nbytes, t.numel() * t.element_size())
            return out

    torch.manual_seed(0)
    attention.register()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=seq,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).float().train()
    kernels.pass_packed_boundaries(model)  # what llmft installs for varlen attention

    def step(n: int) -> None:
        ids = torch.randint(0, 320, (1, n))
        positions = torch.arange(n // examples).repeat(examples)[None]
        model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step(256)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    step(seq)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    with Largest() as mode:
        step(seq)
    return {"peak_mib": peak / 1024, "largest_mib": mode.nbytes / 2**20, "seconds": seconds}


if __name__ == "__main__":
    main()
