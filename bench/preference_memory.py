"""LoRA DPO's peak memory against the same model's SFT peak at the same rows: P pairs per micro-batch
against SFT micro-batches of 2P records holding the same sequences (docs/preference.md "Memory": target <= 1.3x).

What is measured is what bench/memory.py measures (its worker runs each case): on CPU, the peak
resident set size (``VmHWM``) of the training process while the loop runs, minus its resident size
just before the engine is built (data loaded, modules imported: the empty-model baseline), with
``MALLOC_MMAP_THRESHOLD_=65536`` so that RSS follows the live tensors. The cases run at the same
time, one process each (each process's peak is its own).

The cases, all LoRA r=16 on every linear, fp32, sdpa, SGD, one micro-batch per step:

- ``sft``: prompt/completion records, the chosen and the rejected sequence of every pair as two
  records (2P rows of the same lengths);
- ``dpo``: the pairs (sigmoid, reference: the policy with its adapters disabled), with the chunked
  LM head (``model.chunked_loss: auto``, on here);
- ``dpo, whole logits``: the same with ``model.chunked_loss=false``: the logits of all 2P rows exist
  at once (what DPO held before the chunked head took the preference log-probs);
- ``sft, whole logits``: SFT with ``model.chunked_loss=false``, its like for like.

The bench model has a 32k vocabulary (the byte tokenizer uses the first 270 ids), so that the
logits weigh as they do in real models. ``estimate`` is ``llmft.plan.memory``'s total without the
CUDA context.

    python bench/preference_memory.py              # ~5 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
from pathlib import Path

import common
import memory as memory_bench

MIB = 2**20
LORA = {"method": "lora", "r": 16, "target_modules": "all-linear"}
CASES = {  # name: (objective, model.chunked_loss)
    "sft": ("sft", "auto"),
    "dpo": ("dpo", "auto"),
    "sft, whole logits": ("sft", False),
    "dpo, whole logits": ("dpo", False),
}


def write_pairs(tmp: Path, n: int, seq: int, seed: int = 0) -> tuple[Path, Path]:
    """``n`` pairs whose sequences fill ``seq`` tokens (bos + prompt + completion + eos), and the same
    sequences as 2n prompt/completion records."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(k))

    pairs, records = tmp / "pairs.jsonl", tmp / "sft.jsonl"
    with open(pairs, "w") as fp, open(records, "w") as fs:
        for _ in range(n):
            prompt = text(seq // 8)
            chosen, rejected = text(seq - 2 - len(prompt)), text(seq - 2 - len(prompt))
            fp.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
            for completion in (chosen, rejected):
                fs.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return pairs, records


def recipe_for(tmp: Path, data: Path, objective: str, chunked, args) -> Path:
    items = args.pairs if objective == "dpo" else 2 * args.pairs  # one micro-batch of the same rows
    recipe = common.base_recipe(tmp / "run", data, seq=args.seq, micro=items, global_batch=items, steps=args.steps)
    recipe["model"]["config"] = {**common.BENCH_LLAMA, "vocab_size": args.vocab}
    recipe["model"]["chunked_loss"] = chunked
    recipe["peft"] = dict(LORA)
    recipe["optim"].update({"name": "sgd", "lr": 1e-3, "max_grad_norm": None})
    recipe["run"]["tensorboard"] = False
    recipe["data"]["shuffle"] = False
    recipe["train"]["objective"] = objective
    return common.write_recipe(tmp / "recipe.yaml", recipe)


def start(recipe: Path, case: Path) -> subprocess.Popen:
    """bench/memory.py's worker on ``recipe`` (its run dir inside ``case``, the logs beside it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(common.ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, memory_bench.__file__, "--worker", str(recipe)]
    out, err = open(case / "stdout.txt", "w"), open(case / "stderr.txt", "w")
    return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=common.ROOT)


def finish(proc: subprocess.Popen, name: str, case: Path) -> dict:
    if proc.wait(timeout=1800) != 0:
        raise SystemExit(f"{name} failed:\n{(case / 'stderr.txt').read_text()[-4000:]}")
    lines = (case / "stdout.txt").read_text().splitlines()
    return json.loads(next(ln for ln in lines if ln.startswith("MEMORY ")).split(" ", 1)[1])


def estimate_mib(recipe: Path) -> float:
    from llmft.plan.memory import CUDA_CONTEXT_BYTES, estimate_memory
    from llmft.plan.resolve import load_plan

    est = estimate_memory(load_plan(str(recipe), [], world_size=1))
    return (est.total - CUDA_CONTEXT_BYTES) / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch (SFT: twice as many records)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    tmp = common.scratch_dir("llmft-bench-pref-memory-")
    pairs, records = write_pairs(tmp, 4 * args.pairs * args.steps, args.seq)
    recipes, procs, micro = {}, {}, {}
    for name, (objective, chunked) in CASES.items():
        case = tmp / name.replace(", ", "-").replace(" ", "-")
        recipes[name] = recipe_for(case, pairs if objective == "dpo" else records, objective, chunked, args)
        micro[name] = args.pairs if objective == "dpo" else 2 * args.pairs
        procs[name] = start(recipes[name], case)
    results = {name: finish(proc, name, recipes[name].parent) for name, proc in procs.items()}

    def peak(name: str) -> float:
        got = results[name]
        return (got["peak"] - got["rss_before_engine"]) / MIB

    rows = []
    for name, (objective, _) in CASES.items():
        like = "sft, whole logits" if "whole" in name else "sft"
        est = estimate_mib(recipes[name])
        rows.append(
            [
                name,
                f"{args.pairs} pairs" if objective == "dpo" else f"{2 * args.pairs} records",
                2 * args.pairs,
                f"{peak(name):.1f}",
                f"{peak(name) / peak(like):.2f}",
                f"{peak(name) / peak('sft'):.2f}",
                f"{est:.1f}",
                f"{peak(name) / est:.2f}",
            ]
        )
    print(f"machine: {common.machine()}")
    print(
        f"model: llama hidden {common.BENCH_LLAMA['hidden_size']}, {common.BENCH_LLAMA['num_hidden_layers']} layers, "
        f"vocab {args.vocab}, fp32, sdpa; LoRA r=16 all-linear, SGD; {2 * args.pairs} sequences of {args.seq} "
        f"tokens per micro-batch, {args.steps} steps; one process per case, at the same time\n"
    )
    header = [
        "case",
        "micro-batch",
        "rows",
        "measured peak MiB",
        "peak / SFT's (same logits)",
        "peak / SFT's (default)",
        "estimate MiB",
        "measured / estimate",
    ]
    print(common.table(header, rows))


if __name__ == "__main__":
    main()
