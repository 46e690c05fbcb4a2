"""Packing on a long-tailed length mix: the fraction of non-pad tokens, and trained tokens/s.

Records are ``{"text": ...}`` with lognormal lengths (median ~90 tokens, a tail past
``max_seq_len`` 512 that is truncated), the mix of chat / instruction data. Two measurements:

1. Token fractions, from ``llmft.data`` directly: ``build_data`` with ``data.packing`` off and on,
   then one epoch of micro-batches exactly as the trainer draws them (``MicroBatchSampler`` +
   ``collate``, which pads each micro-batch to its longest row). non-pad = real tokens / cells of
   the micro-batch tensors; also shown: what padding every row to ``max_seq_len`` would give.
2. Trained (target) tokens/s from ``llmft train`` with packing off and on, alternating runs in
   this one process, each run's first steps dropped.

    python bench/packing.py          # ~2 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import gc
import math
import random
from pathlib import Path

import common

SMALL_LLAMA = {**common.BENCH_LLAMA, "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 344}


def lognormal_lengths(n: int, seed: int, median: float, sigma: float) -> list[int]:
    rng = random.Random(seed)
    return [max(4, min(4000, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def epoch_counts(recipe_path: Path, packing: bool, micro: int, real_tokens) -> dict:
    """One epoch of micro-batches under the recipe (``data.packing`` set to ``packing``): the
    tensors' cells, real tokens (``real_tokens(batch, pad_id, packing)`` counts a batch's) and
    target tokens, with the recipe, the built data and a micro-batch's row count."""
    from llmft.data import MicroBatchSampler, build_data, collate
    from llmft.data.sampler import GlobalOrder
    from llmft.data.tokenizer import load_tokenizer
    from llmft.plan.batch import BatchPlan
    from llmft.recipe import load_recipe

    recipe = load_recipe(str(recipe_path), [f"data.packing={str(packing).lower()}"])
    tok = load_tokenizer(recipe.model)
    data = build_data(recipe, tok)
    ds = data.train
    steps = len(ds) // micro
    sampler = MicroBatchSampler(GlobalOrder(len(ds), 0, True), BatchPlan(micro, micro, 1, 1), 0, num_steps=steps)
    cells = real = targets = rows = 0
    for indices in sampler:
        batch = collate([ds[i] for i in indices], tok.pad_token_id)
        cells += batch["input_ids"].numel()
        real += int(real_tokens(batch, tok.pad_token_id, packing))
        targets += int((batch["labels"] != -100).sum())
        rows = batch["input_ids"].shape[0]
    return {"recipe": recipe, "data": data, "cells": cells, "real": real, "targets": targets, "rows": rows}


def _sft_real_tokens(batch, pad_id: int, packing: bool):
    # A packed row's padding is only at its tail; an unpacked row says so in its attention mask.
    return (batch["input_ids"] != pad_id).sum() if packing else batch["attention_mask"].sum()


def fractions(recipe_path: Path, packing: bool, micro: int) -> dict[str, float]:
    """Non-pad and target fractions of the micro-batch tensors over one epoch."""
    n = epoch_counts(recipe_path, packing, micro, _sft_real_tokens)
    cells, real, data = n["cells"], n["real"], n["data"]
    seq = n["recipe"].data.max_seq_len
    rows = len(data.train)
    tokens = data.stats["tokens"]
    return {
        "rows": rows,
        "non_pad": real / cells,
        "targets": n["targets"] / cells,
        "cells_per_token": cells / real,
        "static": tokens / (rows * seq),  # every row padded to max_seq_len
        "truncated": data.stats["truncated"],
        "records": data.stats["records"],
    }


def train_rate(recipe_path: Path, packing: bool, warmup: int) -> dict[str, float]:
    """Target tokens per wall second (metrics.jsonl ``step_time_s``) and per CPU second (this
    process, between metrics rows) over the steady steps of one ``llmft train`` run."""
    import time

    from llmft.metrics import record as llmft_metrics
    from llmft.training import train as llmft_train

    cpu: list[float] = []
    original = llmft_metrics.Metrics.write

    def write(self, row):
        original(self, row)
        if row.get("split") == "train":
            cpu.append(time.process_time())

    llmft_metrics.Metrics.write = write
    try:
        assert llmft_train.train(str(recipe_path), [f"data.packing={str(packing).lower()}"]) == 0
    finally:
        llmft_metrics.Metrics.write = original
    rows = common.train_rows(recipe_path.parent / "run")
    tokens = sum(r["tokens"] for r in rows[warmup:])
    return {
        "wall": tokens / sum(r["step_time_s"] for r in rows[warmup:]),
        "cpu": tokens / (cpu[-1] - cpu[warmup - 1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--median", type=float, default=90.0, help="median record length in bytes")
    ap.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma (log scale)")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    common.one_thread()
    common.quiet_llmft()

    tmp = common.scratch_dir("llmft-bench-packing-")
    lengths = lognormal_lengths(args.records, 0, args.median, args.sigma)
    data = common.write_text_records(tmp / "train.jsonl", lengths)
    g = args.micro * args.accumulation
    recipe = common.base_recipe(tmp / "run", data, seq=args.seq, micro=args.micro, global_batch=g, steps=args.steps)
    recipe["model"]["config"] = dict(SMALL_LLAMA)
    recipe["data"]["train_on"] = "all"
    recipe["run"]["tensorboard"] = False
    recipe_path = common.write_recipe(tmp / "recipe.yaml", recipe)

    print(f"machine: {common.machine()}")
    srt = sorted(n + 2 for n in lengths)
    q = lambda p: srt[min(len(srt) - 1, int(p * len(srt)))]  # noqa: E731
    print(
        f"data: {args.records} text records, lognormal lengths in tokens: median {q(0.5)}, p90 {q(0.9)}, "
        f"p99 {q(0.99)}, max {srt[-1]}; max_seq_len {args.seq}\n"
    )

    frac_rows = []
    packed_non_pad = None
    for micro in (1, args.micro, 8):
        for packing in (False, True):
            f = fractions(recipe_path, packing, micro)
            if packing and micro == args.micro:
                packed_non_pad = f["non_pad"]
            frac_rows.append(
                [
                    "packed" if packing else "unpacked (pad to longest in micro-batch)",
                    micro,
                    f["rows"],
                    f"{f['non_pad']:.4f}",
                    f"{f['targets']:.4f}",
                    f"{f['static']:.4f}",
                ]
            )
    header = ["layout", "micro", "dataset rows", "non-pad fraction", "target fraction", "if padded to max_seq_len"]
    print(common.table(header, frac_rows))
    print(f"\n(records truncated to {args.seq}: {f['truncated']} of {f['records']})")

    # tokens/s: alternate packed / unpacked runs.
    rates: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(args.pairs):
        for packing in (False, True) if i % 2 == 0 else (True, False):
            gc.collect()
            rates[packing].append(train_rate(recipe_path, packing, args.warmup))
    print(
        f"\nllmft train, llama hidden {SMALL_LLAMA['hidden_size']}, {SMALL_LLAMA['num_hidden_layers']} layers, fp32, "
        f"sdpa, micro {args.micro} x accumulation {args.accumulation}; {args.pairs} alternating pairs of "
        f"{args.steps} steps, first {args.warmup} dropped\n"
    )
    rows = []
    for key, label in (("wall", "wall time"), ("cpu", "CPU time")):
        ratios = [p[key] / u[key] for p, u in zip(rates[True], rates[False], strict=True)]
        rows.append(
            [
                label,
                common.median([u[key] for u in rates[False]]),
                common.median([p[key] for p in rates[True]]),
                common.median(ratios),
                common.spread(ratios),
            ]
        )
    header = ["measure", "unpacked tokens/s", "packed tokens/s", "packed / unpacked (median of pairs)", "min-max"]
    print(common.table(header, rows))
    print(
        f"\ntarget >= 0.97 non-pad with packing: {'met' if packed_non_pad >= 0.97 else 'NOT met'} "
        f"({packed_non_pad:.4f} at micro {args.micro})"
    )


if __name__ == "__main__":
    main()
