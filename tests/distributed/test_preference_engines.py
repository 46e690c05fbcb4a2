"""DPO on every engine: 2 processes on gloo under torchrun against one process, two SGD steps of
the real engine + objective + loop on the same 8 pairs per step (contract batches built by hand
until the data side collates pair records): the reduced gradients of the second step (where the
policy has left its reference) agree to <= 1e-5 relative (fp32).

docs/design.md G1 (accumulation is the big batch, on every engine); docs/preference.md.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from helpers import ROOT, torchrun_cmd, write_recipe
from preference_batches import make_pairs, micro_batches, preference_step, rel_diff

from llmft.dist import DistEnv
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe

pytestmark = pytest.mark.distributed

NUM_PAIRS = 8
STEPS = 2
# DeepSpeed: one step only. A second step of this harness hangs under DeepSpeed (ZeRO-2 full,
# ZeRO-3 LoRA; not yet understood, docs/preference.md "Status"), so there the reference is only
# checked where it still equals the policy.
STEPS_ON = {"ddp": STEPS, "fsdp": STEPS, "zero2": 1, "zero3": 1}
BASE = [
    "train.objective=dpo",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.max_grad_norm=null",
    f"batch.global_batch_size={NUM_PAIRS}",
]
LORA = ["peft.method=lora", "peft.r=4"]
FULL = ["peft.method=none"]

ENGINES = {
    "ddp": ["distributed.engine=ddp", "batch.micro_batch_size=2"],
    "fsdp": ["distributed.engine=fsdp", "batch.micro_batch_size=2"],
    "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2", "batch.micro_batch_size=2"],
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=1"],
}
CASES = [
    ("sigmoid", "lora", "ddp"),
    ("sigmoid", "lora", "fsdp"),
    ("sigmoid", "lora", "zero2"),
    ("sigmoid", "lora", "zero3"),
    ("sigmoid", "full", "ddp"),
    ("sigmoid", "full", "fsdp"),
    ("sigmoid", "full", "zero2"),
    ("sigmoid", "full", "zero3"),
    ("ipo", "lora", "fsdp"),
    ("ipo", "lora", "zero3"),
    ("simpo", "lora", "ddp"),
    ("simpo", "full", "zero3"),  # reference-free: a full fine-tune runs under ZeRO-3 too
]


def _overrides(loss_type: str, method: str) -> list[str]:
    return [*BASE, f"preference.loss_type={loss_type}", *(LORA if method == "lora" else FULL)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The big batch in one process, per (loss, method)."""
    cache: dict[tuple[str, str, int], tuple[dict[str, torch.Tensor], dict]] = {}

    def get(loss_type: str, method: str, steps: int):
        if (loss_type, method, steps) not in cache:
            tmp = tmp_path_factory.mktemp(f"one-{loss_type}-{method}")
            over = [*_overrides(loss_type, method), f"batch.micro_batch_size={NUM_PAIRS}", "distributed.engine=single"]
            plan = resolve(load_recipe(write_recipe(tmp), over))
            pairs = make_pairs(NUM_PAIRS * steps, seed=5)  # as preference_probe.py
            micro = micro_batches(pairs, NUM_PAIRS)  # one micro-batch per step
            cache[loss_type, method, steps] = preference_step(plan, DistEnv(), micro, steps=steps)
        return cache[loss_type, method, steps]

    return get


@pytest.mark.parametrize("loss_type,method,engine", CASES, ids=["-".join(c) for c in CASES])
def test_two_ranks_equal_one_process(tmp_path, one_process, loss_type, method, engine):
    recipe = write_recipe(tmp_path)
    out = tmp_path / "grads.pt"
    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed/preference_probe.py"), str(recipe), str(out)]
    steps = STEPS_ON[engine]
    cmd += [str(NUM_PAIRS), str(steps), *_overrides(loss_type, method), *ENGINES[engine]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(out)
    want_grads, want_row = one_process(loss_type, method, steps)
    diff = rel_diff(got["grads"], want_grads)
    print(f"{loss_type} {method} {engine}: max relative gradient difference {diff:.2e}")
    assert diff <= 1e-5
    if steps > 1:
        assert want_row["rewards/chosen"] != 0.0  # the policy has left its reference: a wrong one would show
    for key in ("loss", "rewards/chosen", "rewards/margin", "rewards/accuracy", "logps/chosen"):
        assert abs(got["row"][key] - want_row[key]) <= 1e-5 * max(1.0, abs(want_row[key])), key
