"""What the shipped 70B and 8B recipes need per GPU and per node, by the planner (no GPU, no torch).

For each recipe in ``configs/`` that names a large model, on the layout it is compiled for, and
for GPUs of 24 / 40 / 80 / 141 GiB: the planner's total per GPU (``llmft plan``), whether it fits,
and if not, the settings that would (``plan.memory.fit_options``); and the host RAM per node
(``plan.memory.host_memory_per_node``: offloaded state plus the peak of loading the model).

    python bench/fit_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmft.plan.memory import GIB, estimate_memory, fit_options, host_memory_per_node  # noqa: E402
from llmft.plan.resolve import load_plan  # noqa: E402

RECIPES = [
    "llama3-70b-qlora-fsdp-8gpu.yaml",
    "llama3-8b-full-zero3-2x8gpu.yaml",
    "llama3-8b-lora-fsdp-8gpu.yaml",
    "llama3-8b-qlora-1gpu.yaml",
]
GPUS = (24, 40, 80, 141)


def main() -> None:
    print("| recipe | layout | GiB per GPU | " + " | ".join(f"{g} GB GPU" for g in GPUS) + " | host RAM per node GiB |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in GPUS) + " | --- |")
    for name in RECIPES:
        plan = load_plan(ROOT / "configs" / name, ["distributed.gpu_memory_gb=null"])
        est = estimate_memory(plan)
        cells = []
        for gb in GPUS:
            if est.fits(gb):
                cells.append("fits")
            else:
                options = fit_options(plan, gb)
                cells.append("no; fits with " + ", ".join(o.split(" (")[0] for o in options) if options else "no")
        layout = f"{plan.world.nnodes}x{plan.world.nproc_per_node} {plan.engine}, {plan.batch.equation()}"
        host = host_memory_per_node(plan) / GIB
        print(f"| {name} | {layout} | {est.total / GIB:.1f} | " + " | ".join(cells) + f" | {host:.0f} |")


if __name__ == "__main__":
    main()
