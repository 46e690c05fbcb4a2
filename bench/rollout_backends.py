"""GRPO's generation backends side by side: ``rollout.backend: hf`` (transformers ``generate``) and
``vllm`` (a colocated vLLM engine), the same model, prompts, G and sampling, each as ``llmft train``
runs it. Prints, per backend, the completions per second and tokens per second of generation and
the step time split (generation incl. the weight sync, sync, update, the rest), medians over the
steps after the first (the engine's start and first compile are in step 1), and the ratio.

Needs vLLM (on this CPU: the environment ``.ci/vllm`` builds, ``.venv-vllm``):

    .venv-vllm/bin/python bench/rollout_backends.py                 # hidden 512, 4 layers, G 8
    .venv-vllm/bin/python bench/rollout_backends.py --hidden 1024 --layers 8 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_model(out: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    heads = hidden // 64  # head_dim 64: vLLM's CPU attention refuses 16
    config = AutoConfig.for_model(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        intermediate_size=hidden * 3,
        vocab_size=320,
        max_position_embeddings=1024,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)


def write_run(tmp: Path, model: Path, backend: str, args) -> Path:
    import yaml

    prompts = tmp / "prompts.jsonl"
    if not prompts.exists():
        with open(prompts, "w") as f:
            for i in range(args.prompts * args.steps):
                f.write(
                    json.dumps({"prompt": f"task {i}: reverse the word {'abcdefgh'[: 3 + i % 6]}", "answer": "x"})
                    + "\n"
                )
    rewards = tmp / "bench_rewards.py"
    rewards.write_text("def length(prompt, completion, **kw):\n    return float(len(completion))\n")
    recipe = {
        "run": {"output_dir": str(tmp / backend), "seed": 0, "tensorboard": False},
        "model": {"name_or_path": str(model), "dtype": "fp32", "attn_implementation": "sdpa"},
        "data": {"train": str(prompts), "max_seq_len": args.new_tokens + 64, "num_workers": 0, "shuffle": False},
        "train": {"objective": "grpo", "max_steps": args.steps, "progress_bar": False},
        "batch": {"global_batch_size": args.prompts * args.g, "micro_batch_size": args.prompts * args.g},
        "optim": {"name": "sgd", "lr": 1e-3, "max_grad_norm": None},
        "peft": {"method": "lora", "r": 8},
        "rollout": {
            "backend": backend,
            "num_generations": args.g,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "vllm": {"kv_cache_gib": 1.0},
        },
        "rl": {"importance_correction": "none", "reward_workers": 0},
        "rewards": [{"function": "bench_rewards:length"}],
        "checkpoint": {"every_steps": None},
    }
    path = tmp / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run(recipe: Path, tmp: Path, backend: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tmp), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(
        [sys.executable, "-m", "llmft", "train", str(recipe)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if proc.returncode != 0:
        sys.exit(f"{backend} run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (tmp / backend / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--g", type=int, default=8, help="completions per prompt (rollout.num_generations)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmft-bench-rollout-") as d:
        tmp = Path(d)
        model = tmp / "model"
        make_model(model, args.hidden, args.layers)
        results = {}
        for backend in ("hf", "vllm"):
            rows = run(write_run(tmp, model, backend, args), tmp, backend)[1:]  # step 1: start-up
            gen = statistics.median(r["generation_s"] for r in rows)
            tokens = statistics.median(r["generation_tokens_per_s"] for r in rows)
            sync = statistics.median(r.get("sync_s", 0.0) for r in rows)
            update = statistics.median(r["update_s"] for r in rows)
            step = statistics.median(r["step_time_s"] for r in rows)
            results[backend] = (args.prompts * args.g / gen, tokens, gen, sync, update, step)
    print(
        f"GRPO generation, CPU fp32, llama hidden {args.hidden} x {args.layers} layers, {args.prompts} prompts x G "
        f"{args.g}, {args.new_tokens} new tokens, LoRA r 8; medians of steps 2-{args.steps}"
    )
    print(f"{'backend':8} {'compl/s':>9} {'tok/s':>9} {'gen s':>8} {'sync s':>8} {'update s':>9} {'step s':>8}")
    for name, (cps, tps, gen, sync, update, step) in results.items():
        print(f"{name:8} {cps:9.2f} {tps:9.1f} {gen:8.2f} {sync:8.3f} {update:9.2f} {step:8.2f}")
    print(f"vllm / hf generation throughput: {results['vllm'][1] / results['hf'][1]:.2f}x")


if __name__ == "__main__":
    main()
