"""Per-rank peak activation memory of one training step, sequence parallelism 2 against 1.

A Llama whose activations dominate at 8-16K tokens (hidden 128, intermediate 2048, 2 layers, fp32,
~1.6 M parameters: the weights and gradients are ~13 MB, the step's activations hundreds of MB)
trains one step (forward, loss, backward) on ONE sequence of T tokens:

- sp 1: one process, the whole sequence, the model's own sdpa attention;
- sp 2: two ranks under torchrun on gloo, each its slice (``llmft.data.sequence.sequence_slice``)
  through DeepSpeed's Ulysses attention as llmft installs it (``llmft.model.ulysses``) and llmft's
  slice loss (``objectives.sft.micro_loss``).

Each process builds the model and the batch, runs one step to warm up, resets its peak resident
set (``/proc/self/clear_refs`` 5), takes its resident set as the baseline (interpreter, libraries,
the model and its gradients: the empty-model baseline), runs the measured step and reads
``VmHWM``. Activation peak = VmHWM - baseline, per rank (the larger rank for sp 2). llmft's glibc
mmap threshold is set (llmft/job/malloc.py), so freed tensors leave the resident set as in a run.

    python bench/long_context_sp.py                   # T = 8192 and 16384
    python bench/long_context_sp.py --tokens 4096     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import common

MB = 2**20
MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 320,
    "max_position_embeddings": 32768,
}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(tokens: int) -> None:
    """One process of a case: build, warm up, measure one step, print a JSON line."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmft.data.sequence import sequence_slice
    from llmft.job.malloc import use_mmap_for_large_blocks
    from llmft.model import ulysses
    from llmft.objectives.sft import micro_loss

    use_mmap_for_large_blocks()
    common.one_thread()
    sp = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"}, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(3, MODEL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    num_items = torch.tensor(float(tokens - 1))
    if sp > 1:
        dist.init_process_group("gloo")
        ulysses.install(model, sp)
        batch = sequence_slice(batch, dist.get_rank(), sp)

    def step() -> None:
        loss = micro_loss(model, batch, num_items)
        loss.backward()
        del loss

    step()  # warm-up: gradients allocated, kernels and communication buffers set up
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    baseline = _status("VmRSS")
    step()
    peak = _status("VmHWM")
    print("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", "0")), "baseline": baseline, "peak": peak}))
    sys.stdout.flush()
    if sp > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_case(sp: int, tokens: int) -> int:
    """The larger per-rank activation peak (bytes) of ``sp`` ranks on one ``tokens``-token sequence."""
    env = {**os.environ, "PYTHONPATH": str(common.ROOT), "OMP_NUM_THREADS": "1"}
    script = [str(Path(__file__).resolve()), "--worker", "--tokens", str(tokens)]
    if sp == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--master_addr=127.0.0.1",
               f"--master_port={29700 + tokens % 97}", *script]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    rows = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(rows) == sp, done.stdout
    return max(r["peak"] - r["baseline"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.tokens[0])
        return
    print(common.machine())
    print("\n| tokens | sp 1 activation peak per rank | sp 2 activation peak per rank | sp 2 / sp 1 |")
    print("| ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        one, two = run_case(1, tokens), run_case(2, tokens)
        print(f"| {tokens:,} | {one / MB:,.0f} MiB | {two / MB:,.0f} MiB | {two / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
