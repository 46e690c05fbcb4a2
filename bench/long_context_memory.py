"""Peak memory of one long sequence's forward + backward with llmft's long-context switches
(``model.gradient_checkpointing``, ``model.activation_offload``, ``model.tiled_mlp``,
``model.chunked_loss``), each ratio against the plain run, with the planner's activations beside it.

What is measured, on CPU, fp32, one sequence of ``--tokens`` tokens through ``BENCH_LLAMA`` (4 layers,
hidden 256, MLP 688: its activations are hundreds of MiB at 8-16K tokens, its weights 13 MiB): the
peak resident set size (Linux ``VmHWM``) of a fresh process during one micro-step, minus its resident
size just before it (model built, batch made, one short warm-up step taken so that lazily allocated
kernels' buffers are not counted). That difference is the step's working set: the saved activations,
the logits and the backward's temporaries. Each configuration runs in its own process with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the RSS (see bench/memory.py).

What a CPU cannot show: ``activation_offload`` moves the checkpointed layer inputs with torch's
``save_on_cpu``, and on a CPU that is the same memory (the tensors are not even copied), so its row
equals checkpointing's here; tests/unit/test_long_context.py shows which tensors leave the device.
The planner column is ``estimate_memory``'s activations + logits for the same recipe (a CUDA
run's device bytes, where offloaded inputs are in host memory).

    python bench/long_context_memory.py                 # 8192 tokens (~3 min on one thread)
    python bench/long_context_memory.py --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import common

MIB = 2**20
CASES = {
    "baseline": [],
    "chunked_loss": ["model.chunked_loss=true"],
    "tiled_mlp": ["model.tiled_mlp=true"],
    "checkpointing": ["model.gradient_checkpointing=true"],
    "checkpointing+tiled_mlp": ["model.gradient_checkpointing=true", "model.tiled_mlp=true"],
    "activation_offload": ["model.gradient_checkpointing=true", "model.activation_offload=true"],
    "all (offload+tiled+chunked)": [
        "model.gradient_checkpointing=true",
        "model.activation_offload=true",
        "model.tiled_mlp=true",
        "model.chunked_loss=true",
    ],
}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def recipe_file(tmp: Path, tokens: int) -> Path:
    import yaml

    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n")
    model = dict(common.BENCH_LLAMA, max_position_embeddings=max(tokens, 1024))
    recipe = {
        "run": {"output_dir": str(tmp / "run"), "seed": 0},
        "model": {"config": model, "dtype": "fp32", "attn_implementation": "sdpa", "chunked_loss": False},
        "data": {"train": str(data), "max_seq_len": tokens},
        "batch": {"global_batch_size": 1, "micro_batch_size": 1},
        "train": {"max_steps": 1},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def worker(path: str, overrides: list[str]) -> None:
    """One configuration: the step's working set (VmHWM over the RSS before it) and the planner's."""
    import torch

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import prepare_model
    from llmft.plan.memory import estimate_memory
    from llmft.plan.resolve import load_plan

    common.one_thread()
    plan = load_plan(path, overrides, world_size=1)
    model = prepare_model(plan, byte_tokenizer(), torch.device("cpu"))
    from llmft.objectives.sft import micro_loss

    def step(tokens: int) -> None:
        ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as between micro-steps
        micro_loss(model, batch, None).backward()

    step(512)  # warm-up: gradients allocated, kernels' lazy buffers made
    ids_len = plan.recipe.data.max_seq_len
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    step(ids_len)
    peak = _status("VmHWM") - before
    est = estimate_memory(plan)
    print(json.dumps({"peak": peak, "planner": est.activations + est.logits}))


def run_case(path: Path, overrides: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(common.ROOT))
    out = subprocess.run(
        [sys.executable, __file__, "--worker", str(path), *overrides],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1:])
        return
    path = recipe_file(common.scratch_dir("llmft-longctx-"), args.tokens)
    results = {name: run_case(path, overrides) for name, overrides in CASES.items()}
    base = results["baseline"]["peak"]
    print(f"{common.machine()}\n")
    print(f"one sequence of {args.tokens} tokens, fp32, BENCH_LLAMA; step working set = VmHWM - RSS before the step\n")
    print("| configuration | step peak MiB | ratio to baseline | planner activations+logits MiB | measured / planner |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['peak'] / MIB:.0f} | {r['peak'] / base:.2f} | {r['planner'] / MIB:.0f} | "
            f"{r['peak'] / r['planner']:.2f} |"
        )


if __name__ == "__main__":
    main()
