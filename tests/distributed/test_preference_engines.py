"""Preference objectives on every engine: 2 processes on gloo under torchrun against one process, two
SGD steps of the real engine + objective + loop on the same 8 pairs per step (contract batches built
by hand, tests/preference_batches.py): the reduced gradients of the second step (where a DPO policy
has left its reference) agree to <= 1e-5 relative (fp32).

Every engine (DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3) runs every variant: DPO ``sigmoid`` with LoRA
(reference: adapters disabled) and a full fine-tune (a frozen copy), ``ipo`` and ``simpo`` with LoRA,
and the reward model (``train.objective: reward``, its score head) with LoRA and a full fine-tune.
One torchrun launch per engine runs all its variants, one after the other. DeepSpeed runs the two
steps like DDP and FSDP2 (an earlier version of this harness ran one step there, after a second
step was seen to hang; it does not: docs/preference.md "Status").

docs/design.md G1 (accumulation is the big batch, on every engine); docs/preference.md.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers import ROOT, TWO_RANK_ENGINES, engine_cases, torchrun_cmd, write_recipe
from preference_batches import make_pairs, micro_batches, preference_step, rel_diff

from llmft.job.dist import DistEnv
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe

pytestmark = pytest.mark.distributed

NUM_PAIRS = 8
STEPS = 2
BASE = [
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.max_grad_norm=null",
    f"batch.global_batch_size={NUM_PAIRS}",
]
LORA = ["peft.method=lora", "peft.r=4"]
FULL = ["peft.method=none"]
VARIANTS = {
    "sigmoid-lora": ["train.objective=dpo", "preference.loss_type=sigmoid", *LORA],
    "sigmoid-full": ["train.objective=dpo", "preference.loss_type=sigmoid", *FULL],
    # IPO's gradient per pair, 2(h - 1/(2 beta)) = -10 at the start, is 200x DPO's (-beta/2): the same
    # lr would take a step so large that step 2 measures fp32 rounding amplified by it, not the split
    "ipo-lora": ["train.objective=dpo", "preference.loss_type=ipo", *LORA, "optim.lr=0.005"],
    "simpo-lora": ["train.objective=dpo", "preference.loss_type=simpo", *LORA],
    "reward-lora": ["train.objective=reward", *LORA],
    "reward-full": ["train.objective=reward", *FULL],
}
ENGINES = TWO_RANK_ENGINES
CASES = engine_cases(VARIANTS)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The big batch in one process, per variant."""
    cache: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}

    def get(variant: str):
        if variant not in cache:
            tmp = tmp_path_factory.mktemp(f"one-{variant}")
            over = [*BASE, *VARIANTS[variant], f"batch.micro_batch_size={NUM_PAIRS}", "distributed.engine=single"]
            plan = resolve(load_recipe(write_recipe(tmp), over))
            pairs = make_pairs(NUM_PAIRS * STEPS, seed=5)  # as preference_probe.py
            micro = micro_batches(pairs, NUM_PAIRS)  # one micro-batch per step
            cache[variant] = preference_step(plan, DistEnv(), micro, steps=STEPS)
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every variant of one engine, in one 2-rank launch."""
    cache: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in cache:
            tmp = tmp_path_factory.mktemp(f"ranks-{engine}")
            out = tmp / "grads.pt"
            cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed/preference_probe.py"), str(write_recipe(tmp))]
            cmd += [str(out), str(NUM_PAIRS), str(STEPS), json.dumps(VARIANTS), *BASE, *ENGINES[engine]]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
            assert done.returncode == 0, done.stderr[-4000:]
            cache[engine] = torch.load(out)
        return cache[engine]

    return get


@pytest.mark.parametrize("variant,engine", CASES)
def test_two_ranks_equal_one_process(one_process, two_ranks, variant, engine):
    got = two_ranks(engine)[variant]
    want_grads, want_row = one_process(variant)
    diff = rel_diff(got["grads"], want_grads)
    print(f"{variant} {engine}: max relative gradient difference {diff:.2e}")
    assert diff <= 1e-5
    if variant.startswith("reward"):
        assert any("score" in name for name in want_grads)  # the head is trained
    elif not variant.startswith("simpo"):
        assert want_row["rewards/chosen"] != 0.0  # the policy has left its reference: a wrong one would show
    keys = ("loss", "rewards/chosen", "rewards/margin", "rewards/accuracy")
    keys += () if variant.startswith("reward") else ("logps/chosen",)
    for key in keys:
        assert abs(got["row"][key] - want_row[key]) <= 1e-5 * max(1.0, abs(want_row[key])), key
