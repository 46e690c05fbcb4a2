"""DPO step time with ``preference.precompute_reference`` against the on-the-fly reference.

Both runs in this one process, on one CPU thread: the bench Llama (hidden 256, 4 layers, fp32,
sdpa), the same pairs (prompt ~``--prompt`` bytes, completions ~``--completion`` bytes), the same
global batch of pairs, AdamW. Each is a real ``llmft`` run (``Run.setup()`` and ``restore()``:
data, cache, engine, objective, the precompute pass), then their optimizer steps alternate
(on-the-fly, precomputed, on-the-fly, ...) through the real loop, so the machine's load hits both
alike. Per pair of steps a ratio (precomputed / on-the-fly), in wall time and in this process's
CPU time; the table shows the median after ``--warmup`` steps. Cases: a full fine-tune (its
reference a frozen copy of the initial weights) and LoRA (the policy with adapters disabled).
Also shown: the one-off precompute pass, in steps of the on-the-fly run.

    python bench/preference_precompute.py            # ~3 min on 2 shared cores

The target (docs/preference.md "Precomputed reference"): precomputed step time <= 0.8 x on-the-fly.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from pathlib import Path

import common


def write_pairs(path: Path, n: int, prompt: int, completion: int, seed: int = 0) -> Path:
    rng = random.Random(seed)

    def text(n_bytes: int) -> str:
        k = max(1, int(rng.uniform(0.5, 1.5) * n_bytes))
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(prompt), "chosen": text(completion), "rejected": text(completion)}))
            f.write("\n")
    return path


def build_run(tmp: Path, data: Path, args, method: str, precompute: bool):
    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import load_plan
    from llmft.stop import StopRequest
    from llmft.training.run import Run

    name = f"{method}-{'pre' if precompute else 'fly'}"
    recipe = common.base_recipe(
        tmp / name, data, seq=args.seq, micro=args.micro, global_batch=args.batch, steps=args.steps
    )
    recipe["data"]["cache_dir"] = str(tmp / "cache")
    recipe["train"]["objective"] = "dpo"
    recipe["preference"] = {"precompute_reference": precompute}
    recipe["peft"] = {"method": method, "r": 16} if method == "lora" else {"method": "none"}
    plan = load_plan(str(common.write_recipe(tmp / f"{name}.yaml", recipe)))
    run = Run(plan, DistEnv(), StopRequest())
    started = time.perf_counter()
    run.restore(run.setup())
    return run, time.perf_counter() - started


def one_step(run) -> tuple[float, float]:
    """One optimizer step of ``run`` through the real loop: (wall s, CPU s)."""
    from llmft.training.loop import LoopConfig, LoopHooks, train_loop

    hooks = LoopHooks(log_train=lambda row: None, evaluate=lambda s: None, checkpoint=lambda s: None)
    cfg = LoopConfig(max_steps=run.state.step + 1)
    wall, cpu = time.perf_counter(), time.process_time()
    args = (run.engine, run.objective, run.scheduler, run.batches, run.plan.batch, run.env, cfg)
    run.state = train_loop(*args, run.state, hooks, run.stop)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(tmp: Path, data: Path, args, method: str) -> list:
    fly, _ = build_run(tmp, data, args, method, precompute=False)
    pre, setup_s = build_run(tmp, data, args, method, precompute=True)
    meta = json.loads(next((tmp / "cache").glob("*/reference/*/rows.json")).read_text())
    pass_s = meta["seconds"]
    walls, cpus, fly_walls = [], [], []
    for step in range(args.steps):
        a = one_step(fly)
        b = one_step(pre)
        if step >= args.warmup:
            walls.append(b[0] / a[0])
            cpus.append(b[1] / a[1])
            fly_walls.append(a[0])
    for run in (fly, pre):
        run.close()
    for f in (tmp / "cache").glob("*/reference"):  # the next case computes its own
        import shutil

        shutil.rmtree(f)
    step_s = common.median(fly_walls)
    return [
        "full (frozen copy)" if method == "none" else "LoRA (adapters disabled)",
        common.median(walls),
        common.spread(walls),
        common.median(cpus),
        step_s,
        f"{pass_s:.1f} s ({pass_s / step_s:.1f} steps)",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--completion", type=int, default=96)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--methods", default="none,lora")
    args = p.parse_args()
    common.one_thread()
    common.quiet_llmft()
    from llmft.job.dist import DistEnv
    from llmft.training.train import setup_logging

    setup_logging(DistEnv())
    tmp = common.scratch_dir("llmft-bench-precompute-")
    data = write_pairs(tmp / "pairs.jsonl", args.pairs, args.prompt, args.completion)
    rows = [measure(tmp, data, args, m) for m in args.methods.split(",")]
    print(common.machine())
    print(
        f"{args.pairs} pairs (prompt ~{args.prompt}, completions ~{args.completion} bytes), global batch "
        f"{args.batch} pairs, micro {args.micro}; {args.steps - args.warmup} alternating step pairs after "
        f"{args.warmup} warm-up"
    )
    header = [
        "reference", "step time precomputed / on-the-fly (median)", "min-max", "CPU time ratio",
        "on-the-fly step (s)", "precompute pass (one-off)",
    ]  # fmt: skip
    print(common.table(header, rows))


if __name__ == "__main__":
    main()
