"""What the exact global-batch balancing loss costs (docs/moe.md): ``moe.balance: global_batch`` (a
routing pre-pass per step: a no-grad forward of the step's micro-batches, logits of the last
position only) against ``micro_batch`` (transformers' loss per micro-batch, no pre-pass) and the loss
off (``moe.aux_loss_coef: 0``), on CPU, one thread.

One child process per run: ``llmft train`` (``llmft.cli.main``) of a small qwen3_moe (hidden 128, 4
layers, 8 experts, top-2, fp32, sdpa) on text records of ``--seq`` tokens, micro x accumulation;
it prints its peak resident set size (``ru_maxrss``). The three modes run in turn, ``--repeats``
times, so the machine's other load hits each alike; the table gives the median step time over the
steps after the first of every run, its ratio to the loss off, and the largest peak RSS.

    python bench/moe_balance.py                 # ~2 min on 2 shared cores
    python bench/moe_balance.py --checkpointing  # with model.gradient_checkpointing
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 320,
    "max_position_embeddings": 1024,
    "router_aux_loss_coef": 0.01,
}
MODES = {
    "off": ["moe.aux_loss_coef=0"],
    "micro_batch": ["moe.balance=micro_batch"],
    "global_batch": ["moe.balance=global_batch"],
}


def child(recipe: str, *overrides: str) -> None:
    from llmft.cli import main

    common.quiet_llmft()
    code = main(["train", recipe, *overrides])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"code": code, "peak_rss": peak}))


def run(tmp: Path, args: argparse.Namespace, mode: str, repeat: int) -> tuple[list[float], int]:
    out = tmp / f"{mode}-{repeat}"
    recipe = common.base_recipe(
        out,
        tmp / "train.jsonl",
        seq=args.seq,
        micro=args.micro,
        global_batch=args.micro * args.accumulation,
        steps=args.steps,
    )
    recipe["model"]["config"] = dict(MOE)
    recipe["model"]["gradient_checkpointing"] = args.checkpointing
    path = common.write_recipe(tmp / f"{mode}-{repeat}.yaml", recipe)
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(path), *MODES[mode]], capture_output=True, text=True, check=True
    )
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss"]
    times = [row["step_time_s"] for row in common.train_rows(out)[1:]]
    return times, peak


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    tmp = common.scratch_dir("moe-balance-")
    common.write_text_records(tmp / "train.jsonl", [args.seq - 2] * 256)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    peaks: dict[str, int] = dict.fromkeys(MODES, 0)
    for repeat in range(args.repeats):
        for mode in MODES:
            t, peak = run(tmp, args, mode, repeat)
            times[mode] += t
            peaks[mode] = max(peaks[mode], peak)
    base = common.median(times["off"])
    print(common.machine())
    print(
        f"qwen3_moe hidden 128, 4 layers, 8 experts top-2, fp32; micro {args.micro} x accumulation "
        f"{args.accumulation} x seq {args.seq}; checkpointing {'on' if args.checkpointing else 'off'}\n"
    )
    rows = [
        (mode, common.median(times[mode]), common.median(times[mode]) / base, f"{peaks[mode] / 2**20:,.0f}")
        for mode in MODES
    ]
    print(common.table(("moe.balance", "step time (s)", "vs off", "peak RSS (MiB)"), rows))


if __name__ == "__main__":
    main()
