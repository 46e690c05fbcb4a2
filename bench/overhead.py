"""llmft's training loop against a plain PyTorch + transformers loop doing the same work.

Both sides on one CPU thread each, as users run them: ``llmft train`` through its command-line
entry (``llmft.cli.main``: the allocator settings it makes at start-up, llmft/job/malloc.py, included)
in this process, the plain loop in a child process of its own with glibc's defaults (no
``MALLOC_MMAP_THRESHOLD_`` in either environment; the bench restarts itself without one). Both: the same Llama (hidden 256, 4 layers, fp32,
sdpa), the same records (text, every sequence exactly ``--seq`` tokens, so neither side pads),
micro x accumulation, AdamW, gradient clipping at 1.0. The plain loop is what one writes by hand:
a DataLoader over pre-tokenized tensors, ``loss / accumulation``, ``backward``, clip, step, zero.

Side by side, step by step: every time ``llmft train`` writes a train row to metrics.jsonl the
bench asks the child for one step of the plain loop and waits for it. So the two
alternate every ~second (llmft, plain, llmft, plain, ...) and whatever else the machine is
doing hits both alike. An llmft step is timed from the end of the plain step before it to its
own metrics row: its whole loop body, hooks, logging and metrics included. Each pair gives a
ratio; the table shows the median over the pairs after ``--warmup``, in wall time and in CPU
time of this process (which other processes' load disturbs much less), and llmft's own
``tokens_per_s`` from metrics.jsonl.

    python bench/overhead.py                 # ~2 min on 2 shared cores
    python bench/overhead.py --profile       # + cProfile of the steady steps of each side
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import common


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def plain_steps(data: Path, seq: int, micro: int, accumulation: int) -> Iterator[int]:
    """The hand-written loop, one optimizer step per ``next()``; yields the step's target tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    ids = torch.tensor([tok(t)["input_ids"] + [tok.eos_token_id] for t in texts])
    assert ids.shape[1] == seq, ids.shape
    torch.manual_seed(0)
    config = AutoConfig.for_model(**common.BENCH_LLAMA)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(ids, batch_size=micro, shuffle=True, drop_last=True)

    def batches():
        while True:
            yield from loader

    it = batches()
    while True:
        n = 0
        for _ in range(accumulation):
            x = next(it)
            out = model(input_ids=x, attention_mask=torch.ones_like(x), labels=x, use_cache=False)
            (out.loss / accumulation).backward()
            n += x[:, 1:].numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(out.loss.detach())  # a loop logs its loss, as llmft does
        yield n


def plain_worker(data: Path, seq: int, micro: int, accumulation: int, threads: int) -> None:
    """The child: one plain step per line read from stdin; its wall and CPU seconds and target
    tokens as one JSON line on stdout."""
    _threads(threads)
    steps = plain_steps(data, seq, micro, accumulation)
    for _ in sys.stdin:
        start = _now()
        n = next(steps)
        end = _now()
        print(json.dumps([end[0] - start[0], end[1] - start[1], n]), flush=True)


class PlainLoop:
    """The plain loop in its child process, one step per ``next()``: (wall s, CPU s, tokens)."""

    def __init__(self, data: Path, seq: int, micro: int, accumulation: int, threads: int) -> None:
        argv = [sys.executable, __file__, "--plain-worker", str(data), "--seq", str(seq), "--threads", str(threads)]
        argv += ["--micro", str(micro), "--accumulation", str(accumulation)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[float, float, int]:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the plain loop's process ended ({self.proc.wait()})")
        wall, cpu, n = json.loads(line)
        return wall, cpu, n

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _llmft_train(recipe: Path) -> int:
    from llmft.cli import main

    return main(["train", str(recipe)])


def side_by_side(recipe: Path, plain: PlainLoop, steps: int, warmup: int) -> dict:
    """One ``llmft train`` run with a plain-loop step after each of its steps; per-pair rates."""
    from llmft.metrics import record as llmft_metrics

    next(plain)  # the plain model's first step (allocation of grads and Adam state) before timing
    marks: dict[str, list] = {"llmft": [], "plain": []}  # (wall, cpu, tokens) per step
    last_end = [None]
    original = llmft_metrics.Metrics.write

    def write(self, row):
        original(self, row)
        if row.get("split") != "train":
            return
        end = _now()
        if last_end[0] is not None:
            marks["llmft"].append((end[0] - last_end[0][0], end[1] - last_end[0][1], row["tokens"]))
        marks["plain"].append(next(plain))  # timed in the child: its own wall and CPU time
        last_end[0] = _now()

    llmft_metrics.Metrics.write = write
    try:
        assert _llmft_train(recipe) == 0
    finally:
        llmft_metrics.Metrics.write = original
    rows = common.train_rows(recipe.parent / "run")
    # llmft's step k (k >= 2) is marks["llmft"][k-2]; it follows plain step k-1 (marks["plain"][k-2]).
    pairs = list(zip(marks["llmft"], marks["plain"], strict=False))[warmup:]
    steady_rows = rows[warmup + 1 :]

    def rate(m):
        return m[2] / m[0], m[2] / m[1]

    return {
        "wall_ratios": [rate(a)[0] / rate(b)[0] for a, b in pairs],
        "cpu_ratios": [rate(a)[1] / rate(b)[1] for a, b in pairs],
        "metrics_ratios": [r["tokens_per_s"] / rate(b)[0] for r, (_, b) in zip(steady_rows, pairs, strict=False)],
        "llmft_wall": sum(a[2] for a, _ in pairs) / sum(a[0] for a, _ in pairs),
        "plain_wall": sum(b[2] for _, b in pairs) / sum(b[0] for _, b in pairs),
        "llmft_cpu": sum(a[2] for a, _ in pairs) / sum(a[1] for a, _ in pairs),
        "plain_cpu": sum(b[2] for _, b in pairs) / sum(b[1] for _, b in pairs),
        "llmft_metrics": sum(r["tokens"] for r in steady_rows) / sum(r["step_time_s"] for r in steady_rows),
        "data_wait": common.median([r["data_wait_frac"] for r in steady_rows]),
        "pairs": len(pairs),
    }


def profile_llmft(recipe: Path, steps: int, warmup: int, top: int) -> None:
    """cProfile of llmft's steady steps (set-up and the first steps left out)."""
    import cProfile

    from llmft.metrics import record as llmft_metrics

    prof = cProfile.Profile(time.process_time)  # CPU time: the load of other processes does not count
    original = llmft_metrics.Metrics.write
    seen = [0]

    def write(self, row):
        prof.disable()
        original(self, row)
        seen[0] += 1
        if warmup <= seen[0] < steps:
            prof.enable()

    llmft_metrics.Metrics.write = write
    try:
        assert _llmft_train(recipe) == 0
    finally:
        prof.disable()
        llmft_metrics.Metrics.write = original
    _print_profile(prof, "llmft train", top)


def profile_plain(plain: Iterator[int], steps: int, warmup: int, top: int) -> None:
    import cProfile

    for _ in range(warmup):
        next(plain)
    prof = cProfile.Profile(time.process_time)  # CPU time: the load of other processes does not count
    prof.enable()
    for _ in range(steps - warmup):
        next(plain)
    prof.disable()
    _print_profile(prof, "plain loop", top)


def _print_profile(prof, label: str, top: int) -> None:
    import io
    import pstats

    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    # Own time by where the code lives: what is not torch / transformers is loop overhead.
    where: dict[str, float] = {}
    total = 0.0
    for (filename, _, _func), (_, _, tottime, _, _) in stats.stats.items():
        total += tottime
        if "/llmft/" in filename:
            key = "llmft/ (loop, data, metrics)"
        elif "torch/utils/data" in filename:
            key = "torch DataLoader"
        elif "tensorboard" in filename or "tensorboardX" in filename:
            key = "tensorboard"
        elif "/transformers/" in filename:
            key = "transformers (Python)"
        elif "/torch/" in filename or filename == "~":
            key = "torch (Python and C++ ops, backward)"
        else:
            key = "other (json, stdlib, bench)"
        where[key] = where.get(key, 0.0) + tottime
    rows = [[k, f"{v:.3f}", f"{v / total:.1%}"] for k, v in sorted(where.items(), key=lambda kv: -kv[1])]
    print(f"\n### cProfile of the steady steps: {label}\n")
    print(common.table(["own time in", "s", "share"], rows))
    print(f"\n```\n{s.getvalue().strip()}\n```")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=45, help="optimizer steps of each side")
    ap.add_argument("--warmup", type=int, default=3, help="pairs dropped at the start")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument(
        "--no-tensorboard", action="store_true", help="run.tensorboard=false (default: on, as in the schema)"
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each side (0: torch's default)")
    ap.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_worker:
        plain_worker(Path(args.plain_worker), args.seq, args.micro, args.accumulation, args.threads)
        return
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # glibc read it at start: run again as users do
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    _threads(args.threads)
    common.quiet_llmft()

    tmp = common.scratch_dir("llmft-bench-overhead-")
    # bos + (seq - 2) bytes + eos = seq tokens: no padding anywhere.
    data = common.write_text_records(tmp / "train.jsonl", [args.seq - 2] * 512)
    global_batch = args.micro * args.accumulation
    recipe = common.base_recipe(
        tmp / "run", data, seq=args.seq, micro=args.micro, global_batch=global_batch, steps=args.steps
    )
    recipe["data"]["train_on"] = "all"
    recipe["run"]["tensorboard"] = not args.no_tensorboard
    recipe_path = common.write_recipe(tmp / "recipe.yaml", recipe)

    plain = PlainLoop(data, args.seq, args.micro, args.accumulation, args.threads)
    r = side_by_side(recipe_path, plain, args.steps, args.warmup)

    print(f"machine: {common.machine()}")
    print(
        f"model: llama hidden {common.BENCH_LLAMA['hidden_size']}, {common.BENCH_LLAMA['num_hidden_layers']} "
        f"layers, fp32, sdpa; seq {args.seq}, micro {args.micro} x accumulation {args.accumulation} "
        f"= {global_batch} sequences ({global_batch * (args.seq - 1)} target tokens) per step; "
        f"{r['pairs']} alternating step pairs after {args.warmup} dropped; run.tensorboard={not args.no_tensorboard}\n"
    )
    rows = [
        ["wall time", r["llmft_wall"], r["plain_wall"], common.median(r["wall_ratios"]), _iqr(r["wall_ratios"])],
        ["CPU time", r["llmft_cpu"], r["plain_cpu"], common.median(r["cpu_ratios"]), _iqr(r["cpu_ratios"])],
        [
            "llmft tokens_per_s (metrics.jsonl) vs plain wall",
            r["llmft_metrics"],
            r["plain_wall"],
            common.median(r["metrics_ratios"]),
            _iqr(r["metrics_ratios"]),
        ],
    ]
    header = ["measure", "llmft tokens/s", "plain tokens/s", "llmft / plain (median of pairs)", "interquartile"]
    print(common.table(header, rows))
    print(f"\nllmft data_wait_frac (median): {r['data_wait']:.4f}")
    wall, cpu = common.median(r["wall_ratios"]), common.median(r["cpu_ratios"])
    print(
        f"target llmft >= 0.95 x plain: wall {'met' if wall >= 0.95 else 'NOT met'} ({wall:.3f}), "
        f"CPU {'met' if cpu >= 0.95 else 'NOT met'} ({cpu:.3f})"
    )

    if args.profile:
        steps = min(args.steps, 10)
        recipe["train"]["max_steps"] = steps
        common.write_recipe(recipe_path, recipe)
        profile_llmft(recipe_path, steps, args.warmup, 25)
        profile_plain(plain_steps(data, args.seq, args.micro, args.accumulation), steps, args.warmup, 25)
    plain.close()


def _threads(n: int) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _iqr(xs: list[float]) -> str:
    import statistics

    q = statistics.quantiles(xs, n=4)
    return f"{q[0]:.3f}-{q[2]:.3f}"


if __name__ == "__main__":
    main()
