"""Run under torchrun: a few steps of preference runs through the real engine, objective and loop,
on contract micro-batches built by hand (tests/preference_batches.py), and save the reduced
gradients the optimizer stepped with at the last step. Several variants (objective, loss, method)
run one after the other in one launch, each with its own engine, on the same process group.

Arguments: RECIPE OUT_FILE NUM_PAIRS STEPS VARIANTS_JSON [KEY=VALUE ...]. VARIANTS_JSON maps a
variant's name to its overrides (applied after the common KEY=VALUEs). Each step takes the next
NUM_PAIRS pairs; rank r takes the r-th contiguous share of them, cut into micro-batches. Rank 0
writes {name: {"grads": ..., "row": ...}} to OUT_FILE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared batch builder

from preference_batches import make_pairs, micro_batches, preference_step  # noqa: E402

from llmft.job.dist import init_distributed, leave_process, read_env, timeout_s  # noqa: E402
from llmft.plan.resolve import load_plan  # noqa: E402


def main(recipe: str, out: str, num_pairs: str, steps: str, variants: str, *overrides: str) -> None:
    env = read_env()
    results = {}
    for i, (name, extra) in enumerate(json.loads(variants).items()):
        plan = load_plan(recipe, [*overrides, *extra], world_size=env.world_size, local_world_size=env.local_world_size)
        if i == 0:
            d = plan.recipe.distributed
            init_distributed(env, d.backend, timeout_s(d), force=plan.spec.multi_rank)
        per_step, share = int(num_pairs), int(num_pairs) // env.world_size
        pairs = make_pairs(per_step * int(steps), seed=5)
        mine = []
        for start in range(0, len(pairs), per_step):
            rank_start = start + env.rank * share
            mine += micro_batches(pairs[rank_start : rank_start + share], plan.batch.micro_batch_size)
        grads, row = preference_step(plan, env, mine, steps=int(steps))
        results[name] = {"grads": grads, "row": row}
        print(f"rank {env.rank}: {name} done", flush=True)
    if env.is_main:
        torch.save(results, out)
    # Without the interpreter's teardown (llmft.job.dist.leave_process says why): the engines' gloo
    # groups are still referenced here, so finalizing would destroy them with their worker threads.
    leave_process(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
