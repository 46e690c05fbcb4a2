"""The router's balancing loss over ranks (llmft/model/moe.py; docs/moe.md): 2 processes on gloo
under torchrun, each with 2 of the 4 examples of every step, on DDP, FSDP2, ZeRO-2 and ZeRO-3, give
after two SGD steps the gradients (and logged loss, balancing loss and expert load) of one process
with the whole batch, for tiny qwen3_moe and mixtral models with a coefficient that matters (0.5).
The loss needs the routing of the global batch before the first backward: the routing pre-pass of
each rank, all-reduced with the step's counts, gives it (and under FSDP2 and ZeRO-3 its forwards
gather parameters collectively: every rank runs as many).

This file is also the probe that torchrun runs on each rank: ``python test_moe_ranks.py RECIPE
OUT_FILE VARIANTS_JSON [KEY=VALUE ...]``; rank 0 writes {variant: {"grads": ..., "row": ...}}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, the step harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the examples and the tiny families

from helpers import ROOT, TWO_RANK_ENGINES, torchrun_cmd, write_recipe  # noqa: E402
from preference_batches import preference_step  # noqa: E402
from test_aux_loss import GLOBAL, examples  # noqa: E402
from test_moe import FAMILIES, max_abs_diff  # noqa: E402

from llmft.data import collate  # noqa: E402

pytestmark = pytest.mark.distributed

STEPS = 2
COMMON = [f"batch.global_batch_size={GLOBAL}", "optim.name=sgd", "optim.lr=0.5", "optim.max_grad_norm=null"]
VARIANTS = {
    "qwen3_moe": ["moe.aux_loss_coef=0.5"],
    "mixtral": ["moe.aux_loss_coef=0.5"],
    # ranks x accumulation 2 with checkpointing (ZeRO-3 runs micro 1 already)
    "qwen3_moe-checkpointing": ["moe.aux_loss_coef=0.5", "model.gradient_checkpointing=true"],
}
ROWS = ("loss", "aux/moe_balance", "moe/load_max_over_mean", "moe/load_max_over_mean_avg", "moe/router_entropy")


def family_overrides(variants: dict[str, list[str]], variant: str) -> list[str]:
    """The tiny family a variant names (``qwen3_moe-checkpointing``: qwen3_moe) and the variant's keys."""
    return [f"model.config={json.dumps(FAMILIES[variant.split('-')[0]])}", *variants[variant]]


def _overrides(variant: str) -> list[str]:
    return family_overrides(VARIANTS, variant)


def _steps(micro: int, rank: int = 0, world: int = 1) -> list[dict]:
    """This rank's micro-batches of every step: the r-th share of the 4 examples, each step."""
    share = GLOBAL // world
    mine = examples()[rank * share : (rank + 1) * share]
    return [collate(mine[i : i + micro], 0) for _ in range(STEPS) for i in range(0, share, micro)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    out = {}
    for variant in VARIANTS:
        tmp = tmp_path_factory.mktemp(f"one-{variant}")
        over = [*COMMON, *_overrides(variant), f"batch.micro_batch_size={GLOBAL}", "distributed.engine=single"]
        plan = resolve(load_recipe(write_recipe(tmp), over))
        out[variant] = preference_step(plan, DistEnv(), _steps(GLOBAL), steps=STEPS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(TWO_RANK_ENGINES))
def test_two_ranks_equal_one_process_big_batch(tmp_path, one_process, engine):
    keys = [*COMMON, *TWO_RANK_ENGINES[engine], "batch.micro_batch_size=1"]  # ranks x accumulation 2
    got = launch(__file__, tmp_path, [json.dumps(VARIANTS)], keys)
    for variant, (want_grads, want_row) in one_process.items():
        diff = max_abs_diff(got[variant]["grads"], want_grads)
        print(f"{engine} {variant}: step {STEPS} gradients differ by {diff:.2e}")
        assert diff <= 1e-5, (variant, diff)
        assert want_row["aux/moe_balance"] > 0.1 * want_row["loss"]
        for key in ROWS:
            assert got[variant]["row"][key] == pytest.approx(want_row[key], rel=1e-5), (variant, key)


def launch(probe: str, tmp_path: Path, args: list[str], keys: list[str]) -> dict:
    """``probe`` on 2 ranks under torchrun (``probe RECIPE OUT *args *keys``, a recipe written in
    ``tmp_path``); what rank 0 saved to OUT."""
    out = tmp_path / "ranks.pt"
    cmd = [*torchrun_cmd(), probe, str(write_recipe(tmp_path)), str(out), *args, *keys]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def run_variants(recipe: str, out: str, variants: dict[str, list[str]], names: list[str], *overrides: str) -> None:
    """Under torchrun: each variant's two steps on this rank's share (``_steps``); rank 0 saves every
    variant's gradients and metrics row to ``out``."""
    from llmft.job.dist import init_distributed, leave_process, read_env, timeout_s
    from llmft.plan.resolve import load_plan

    env = read_env()
    results = {}
    for i, variant in enumerate(names):
        over = [*overrides, *family_overrides(variants, variant)]
        plan = load_plan(recipe, over, world_size=env.world_size, local_world_size=env.local_world_size)
        if i == 0:
            d = plan.recipe.distributed
            init_distributed(env, d.backend, timeout_s(d), force=plan.spec.multi_rank)
        micro = _steps(plan.batch.micro_batch_size, env.rank, env.world_size)
        grads, row = preference_step(plan, env, micro, steps=STEPS)
        results[variant] = {"grads": grads, "row": row}
    if env.is_main:
        torch.save(results, out)
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)


def main(recipe: str, out: str, variants: str, *overrides: str) -> None:
    run_variants(recipe, out, VARIANTS, json.loads(variants), *overrides)


if __name__ == "__main__":
    main(*sys.argv[1:])
