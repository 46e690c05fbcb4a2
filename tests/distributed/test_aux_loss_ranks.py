"""Auxiliary loss terms over ranks (llmft/model/aux_loss.py; docs/design.md, "Auxiliary loss
terms"): 2 DDP processes on gloo, each with 2 of the 4 examples in one micro-batch (2 ranks x
(micro 2, accumulation 1)), give the gradient of one process with all 4 (micro 4, accumulation 1)
and of the hand-written total loss on the big batch, with both test terms of
tests/unit/test_aux_loss.py attached: one normalised by the step's global target tokens, one by
its own count (rows), which rides on the step's all-reduce of counts. The logged ``aux/<name>``
values are the global batch's.

This file is also the probe that torchrun runs on each rank: ``python test_aux_loss_ranks.py
RECIPE OUT_FILE [KEY=VALUE ...]``; rank 0 writes {"grads": ..., "row": ...} to OUT_FILE.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the terms and the one-step loop

from helpers import ROOT, torchrun_cmd, write_recipe  # noqa: E402
from test_aux_loss import GLOBAL, HiddenL2, RowMean, big_batch, examples, loop_step  # noqa: E402

from llmft.data import collate  # noqa: E402

pytestmark = pytest.mark.distributed

COMMON = [f"batch.global_batch_size={GLOBAL}", "optim.name=sgd", "optim.max_grad_norm=null"]
DDP = ["distributed.engine=ddp", f"batch.micro_batch_size={GLOBAL // 2}"]


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_two_ddp_ranks_equal_one_process_with_the_terms(tmp_path):
    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    out = tmp_path / "ranks.pt"
    cmd = [*torchrun_cmd(), __file__, str(write_recipe(tmp_path / "ranks")), str(out), *COMMON, *DDP]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(out)

    plan = resolve(load_recipe(write_recipe(tmp_path / "one"), [*COMMON, f"batch.micro_batch_size={GLOBAL}"]))
    want_grads, want_row = loop_step(plan, DistEnv(), [collate(examples(), 0)], (HiddenL2(), RowMean()))
    ref, values = big_batch(tmp_path)
    print(f"2 ranks vs one process: {_max_abs_diff(got['grads'], want_grads):.2e}")
    assert _max_abs_diff(got["grads"], want_grads) < 1e-6
    assert _max_abs_diff(got["grads"], ref) < 1e-6
    for key in ("loss", "aux/hidden_l2", "aux/row_mean"):
        assert got["row"][key] == pytest.approx(want_row[key], rel=1e-6), key
        assert got["row"][key] == pytest.approx(values[key], rel=1e-6), key
    assert got["row"]["tokens"] == want_row["tokens"]


def main(recipe: str, out: str, *overrides: str) -> None:
    from llmft.job.dist import init_distributed, leave_process, read_env, timeout_s
    from llmft.plan.resolve import load_plan

    env = read_env()
    plan = load_plan(recipe, list(overrides), world_size=env.world_size, local_world_size=env.local_world_size)
    d = plan.recipe.distributed
    init_distributed(env, d.backend, timeout_s(d), force=plan.spec.multi_rank)
    share = GLOBAL // env.world_size
    mine = examples()[env.rank * share : (env.rank + 1) * share]
    grads, row = loop_step(plan, env, [collate(mine, 0)], (HiddenL2(), RowMean()))
    if env.is_main:
        torch.save({"grads": grads, "row": row}, out)
    # Without the interpreter's teardown (llmft.job.dist.leave_process says why).
    leave_process(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
