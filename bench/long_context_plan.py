"""The planner's longest sequence per GPU for Llama-3.1-8B: LoRA and full fine-tuning on H100
(80 GB) and H200 (141 GB), sequence parallel 1, 2, 8, with and without activation offload, beside
the published ALST numbers (docs/long-context.md). Planner only: nothing is measured here.

With ``sequence_parallel`` N on N GPUs (data-parallel 1) the run is DeepSpeed ZeRO-3 over all N
ranks (ALST's layout: ZeRO partitions over the whole world, sequence ranks included; the planner
shards over data-parallel x sequence-parallel ranks), so weights, gradients and optimizer state are
divided by N and each rank holds 1/N of every sequence. The key
``distributed.sequence_parallel`` belongs to the sequence-parallel work (docs/long-context.md); where
this checkout's schema lacks it the planner reads it with a default of 1, so the script sets it on
the recipe object directly.

    python bench/long_context_plan.py
"""

from __future__ import annotations

import common

from llmft.plan.memory import longest_sequence
from llmft.plan.resolve import load_plan

BASE = [
    "model.name_or_path=meta-llama/Llama-3.1-8B",
    "model.config=null",
    "model.dtype=bf16",
    "model.attn_implementation=sdpa",
    "model.gradient_checkpointing=true",
    "model.tiled_mlp=true",
    "model.chunked_loss=true",
    "peft.dropout=0",
    "batch.global_batch_size=1",
    "batch.micro_batch_size=1",
    "distributed.engine=deepspeed",
    "distributed.zero_stage=3",
]
GPUS = {"H100 80 GB": 79.1, "H200 141 GB": 139.8}  # what torch reports as total memory, GiB
METHODS = {
    "LoRA r 16": ["peft.method=lora", "peft.r=16"],
    "full": ["peft.method=none", "optim.name=adamw", "distributed.offload_optimizer=cpu"],
}


def longest(path: str, method: list[str], sp: int, offload: bool, gb: float) -> int:
    overrides = [*BASE, *method, f"model.activation_offload={str(offload).lower()}"]
    plan = load_plan(path, overrides, world_size=1)
    plan.recipe.distributed.sequence_parallel = sp  # see the module docstring
    return longest_sequence(plan.recipe, plan.engine, 1, gb, 1)  # data-parallel 1: the N GPUs share one sequence


def recipe_path() -> str:
    """A minimal recipe file the overrides complete (the data file is never read by the planner)."""
    path = common.scratch_dir("llmft-lcplan-") / "recipe.yaml"
    path.write_text("data:\n  train: data.jsonl\ntrain:\n  max_steps: 1\n")
    return str(path)


def main() -> None:
    path = recipe_path()
    print("| model | method | GPU | sp (GPUs) | longest, no offload | longest, activation offload |")
    print("|---|---|---|---:|---:|---:|")
    for gpu, gb in GPUS.items():
        for name, method in METHODS.items():
            for sp in (1, 2, 8):
                plain, off = (longest(path, method, sp, o, gb) for o in (False, True))
                print(f"| Llama-3.1-8B | {name} | {gpu} | {sp} | {plain / 1024:,.0f}K | {off / 1024:,.0f}K |")


if __name__ == "__main__":
    main()
