"""Memory of the loss: plain (whole fp32 logits) against chunked (``model.chunked_loss``), on CPU.

One process per case builds a small Llama with a 32k vocabulary in fp32, then runs one
forward + backward of ``loop.micro_loss`` on one row of 4096 tokens (micro 1). Measured: the
peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the
micro-step) minus the resident size at that moment, i.e. what the micro-step adds on top of the
model. ``MALLOC_MMAP_THRESHOLD_=65536`` makes every large tensor its own mapping, so RSS follows
the live tensors. Beside it: the planner's ``logits`` component for the same recipe.

    python bench/chunked_loss.py [--seq 4096] [--vocab 32000]

Prints a markdown table; the goal is chunked extra memory <= 1/4 of the plain path's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

MIB = 2**20
SHAPE = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "max_position_embeddings": 8192,
}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _recipe(tmp: Path, seq: int, vocab: int, chunked: bool) -> Path:
    import yaml

    data = {
        "model": {
            "config": {**SHAPE, "vocab_size": vocab},
            "dtype": "fp32",
            "attn_implementation": "sdpa",
            "gradient_checkpointing": True,  # the layers' activations small: the loss dominates
            "chunked_loss": chunked,
        },
        "data": {"train": "unused.jsonl", "max_seq_len": seq},
        "batch": {"global_batch_size": 1, "micro_batch_size": 1},
        "train": {"max_steps": 1},
        "distributed": {"engine": "single"},
    }
    path = tmp / f"recipe-{'chunked' if chunked else 'plain'}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def worker(recipe: str) -> None:
    import torch

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import prepare_model
    from llmft.plan.memory import estimate_memory
    from llmft.plan.resolve import load_plan
    from llmft.training.loop import micro_loss

    torch.set_num_threads(1)
    plan = load_plan(recipe)
    tokenizer = byte_tokenizer()
    model = prepare_model(plan, tokenizer, torch.device("cpu"))
    seq, vocab = plan.recipe.data.max_seq_len, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (1, seq), generator=g)}
    batch["labels"] = batch["input_ids"].clone()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    num_items = torch.tensor(float(seq - 1))
    model.train()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    loss = micro_loss(model, batch, num_items)
    loss.backward()
    extra = _status("VmHWM") - before
    est = estimate_memory(plan)
    print(json.dumps({"chunked": plan.chunked_loss, "extra": extra, "logits_est": est.logits, "loss": loss.item()}))


def run_case(recipe: Path) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(recipe)], capture_output=True, text=True, env=env, timeout=1200
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = {c: run_case(_recipe(Path(tmp), args.seq, args.vocab, c)) for c in (False, True)}
    plain, chunked = rows[False], rows[True]
    print(f"one row of {args.seq} tokens, vocab {args.vocab}, fp32, micro 1, one process\n")
    print("| loss path | extra memory of one micro-step MiB | planner: logits MiB | loss |")
    print("| --- | --- | --- | --- |")
    for name, r in (("plain", plain), ("chunked", chunked)):
        print(f"| {name} | {r['extra'] / MIB:.0f} | {r['logits_est'] / MIB:.0f} | {r['loss']:.6f} |")
    print(f"\nchunked / plain extra memory: {chunked['extra'] / plain['extra']:.3f} (goal <= 0.25)")


if __name__ == "__main__":
    main()
