"""Padding-free preference pairs (``data.packing: true`` under ``train.objective: dpo``) against
padded ones on a long-tailed length mix: the non-pad fraction of the micro-batches
(docs/preference.md "Records", padding-free: target >= 0.97) and trained tokens/s.

Pairs are ``{"prompt", "chosen", "rejected"}`` strings with lognormal lengths (prompt median ~60
bytes, each completion median ~80, tails truncated at ``max_seq_len``), chosen and rejected of
independent lengths, as real preference data has. Two measurements:

1. Token fractions, from ``llmft.data`` directly: ``build_data`` under ``dpo``, then one epoch of
   micro-batches of P pairs exactly as the trainer draws them (``MicroBatchSampler`` + ``collate``:
   2P right-padded rows, or one padding-free row). non-pad = the sequences' tokens / cells of the
   micro-batch tensors.
2. Trained tokens/s from ``llmft train`` (LoRA DPO, reference: adapters disabled) with packing off
   and on, alternating runs in this one process, each run's first steps dropped (bench/packing.py's
   ``train_rate``).

    python bench/preference_packing.py          # ~3 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import string
from pathlib import Path

import common
import packing as packing_bench


def write_pairs(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    prompts = packing_bench.lognormal_lengths(n, seed, 60.0, 0.8)
    chosen = packing_bench.lognormal_lengths(n, seed + 1, 80.0, 0.9)
    rejected = packing_bench.lognormal_lengths(n, seed + 2, 80.0, 0.9)

    def text(k: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(k))

    with open(path, "w") as f:
        for p, c, r in zip(prompts, chosen, rejected, strict=True):
            f.write(json.dumps({"prompt": text(p), "chosen": text(c), "rejected": text(r)}) + "\n")
    return path


def fractions(recipe_path: Path, packing: bool, micro: int) -> dict[str, float]:
    """Non-pad and target fractions of the micro-batch tensors over one epoch of pairs: a real
    token is one that belongs to a sequence (``sequence_index >= 0``), chosen or rejected."""
    n = packing_bench.epoch_counts(
        recipe_path, packing, micro, lambda batch, pad_id, packing: (batch["sequence_index"] >= 0).sum()
    )
    cells = n["cells"]
    return {
        "pairs": len(n["data"].train),
        "non_pad": n["real"] / cells,
        "targets": n["targets"] / cells,
        "rows": n["rows"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4, help="pairs per micro-batch")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="alternating (padded, padding-free) run pairs")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    common.one_thread()
    common.quiet_llmft()

    tmp = common.scratch_dir("llmft-bench-pref-packing-")
    data = write_pairs(tmp / "pairs.jsonl", args.pairs)
    g = args.micro * args.accumulation
    recipe = common.base_recipe(tmp / "run", data, seq=args.seq, micro=args.micro, global_batch=g, steps=args.steps)
    recipe["model"]["config"] = dict(packing_bench.SMALL_LLAMA)
    recipe["train"]["objective"] = "dpo"
    recipe["peft"] = {"method": "lora", "r": 8}
    recipe["run"]["tensorboard"] = False
    recipe_path = common.write_recipe(tmp / "recipe.yaml", recipe)

    print(f"machine: {common.machine()}")
    print(
        f"data: {args.pairs} string pairs, lognormal lengths in bytes: prompt median 60, chosen and rejected "
        f"median 80 each (sigma 0.8 / 0.9, independent); max_seq_len {args.seq}\n"
    )
    frac_rows, free_non_pad = [], None
    for micro in (1, args.micro, 8):
        for packing in (False, True):
            f = fractions(recipe_path, packing, micro)
            if packing and micro == args.micro:
                free_non_pad = f["non_pad"]
            layout = "padding-free (one row)" if packing else f"padded ({2 * micro} rows, to the longest)"
            frac_rows.append([layout, micro, f["pairs"], f"{f['non_pad']:.4f}", f"{f['targets']:.4f}"])
    header = ["layout", "pairs per micro-batch", "pairs", "non-pad fraction", "target fraction"]
    print(common.table(header, frac_rows))

    rates: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(args.repeats):
        for packing in (False, True) if i % 2 == 0 else (True, False):
            gc.collect()
            rates[packing].append(packing_bench.train_rate(recipe_path, packing, args.warmup))
    print(
        f"\nllmft train, LoRA r=8 DPO (sigmoid, reference: adapters disabled), llama hidden "
        f"{packing_bench.SMALL_LLAMA['hidden_size']}, {packing_bench.SMALL_LLAMA['num_hidden_layers']} layers, "
        f"fp32, sdpa, {args.micro} pairs x accumulation {args.accumulation}; {args.repeats} alternating pairs of "
        f"runs of {args.steps} steps, first {args.warmup} dropped\n"
    )
    rows = []
    for key, label in (("wall", "wall time"), ("cpu", "CPU time")):
        ratios = [p[key] / u[key] for p, u in zip(rates[True], rates[False], strict=True)]
        padded, free = (common.median([r[key] for r in rates[k]]) for k in (False, True))
        rows.append([label, padded, free, common.median(ratios), common.spread(ratios)])
    header = ["measure", "padded tokens/s", "padding-free tokens/s", "padding-free / padded (median)", "min-max"]
    print(common.table(header, rows))
    verdict = "met" if free_non_pad >= 0.97 else "NOT met"
    print(
        f"\ntarget >= 0.97 non-pad padding-free: {verdict} ({free_non_pad:.4f} at {args.micro} pairs per micro-batch)"
    )


if __name__ == "__main__":
    main()
