"""QLoRA DPO, and DPO through the chunked LM head, on FSDP2 and on DeepSpeed ZeRO-3: 2 processes
on gloo under torchrun against one process, the same harness as test_preference_engines.py
(tests/distributed/preference_probe.py: the real engine + objective + loop on the same 8 pairs per
step).

QLoRA: the base weights in 4-bit NF4 (bitsandbytes, on CPU) and LoRA adapters on top.

The reference is the plan's ``adapters_disabled``: the sharded policy itself inside PEFT's
``disable_adapter()`` (the plan's decision is asserted below: no second model is built), so the reference forward
gathers each layer's packed 4-bit shards as the policy forward does and never a whole copy.

Compute is fp32 (the NF4 weights are dequantized to fp32; the packed bytes are stored in the
compute dtype so FSDP2 and ZeRO-3 can shard them, and the sharded build quantizes to the same
bytes as the whole one: tests/distributed/test_fsdp_meta.py, test_zero3_meta.py), so the bound is
the fp32 one of the other engines: <= 1e-5 relative.

docs/design.md G1; docs/preference.md.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers import ROOT, torchrun_cmd, write_recipe
from preference_batches import make_pairs, micro_batches, preference_step, rel_diff

from llmft.job.dist import DistEnv
from llmft.plan.objectives import ADAPTERS_DISABLED
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NUM_PAIRS = 8
BASE = [
    "train.objective=dpo",
    "preference.loss_type=sigmoid",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.max_grad_norm=null",
    f"batch.global_batch_size={NUM_PAIRS}",
]
LORA = ["peft.method=lora", "peft.r=4"]
QLORA = [*BASE, *LORA, "model.quantization={bits: 4}"]
# The chunked head (model.chunked_loss=true; llmft/model/loss.py): the sharded head is gathered by its own
# forward call once, the chunks run its original forward (as for SFT's chunked loss).
CHUNKED = {
    "lora": [*BASE, *LORA, "model.chunked_loss=true"],
    "full": [*BASE, "peft.method=none", "model.chunked_loss=true"],
}
# Two steps: the second after the policy has left its reference.
ENGINES = {
    "fsdp": (["distributed.engine=fsdp", "batch.micro_batch_size=2"], 2),
    "zero3": (["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=2"], 2),
}


def _two_ranks_against_one(tmp_path, overrides: list[str], engine: str) -> str:
    over, steps = ENGINES[engine]
    recipe = write_recipe(tmp_path)
    plan = resolve(
        load_recipe(recipe, [*overrides, f"batch.micro_batch_size={NUM_PAIRS}", "distributed.engine=single"])
    )
    micro = micro_batches(make_pairs(NUM_PAIRS * steps, seed=5), NUM_PAIRS)  # as preference_probe.py
    want_grads, want_row = preference_step(plan, DistEnv(), micro, steps=steps)

    out = tmp_path / "grads.pt"
    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed/preference_probe.py"), str(recipe), str(out)]
    cmd += [str(NUM_PAIRS), str(steps), json.dumps({"case": []}), *overrides, *over]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(out)["case"]
    diff = rel_diff(got["grads"], want_grads)
    print(f"{' '.join(overrides[-3:])} {engine} ({steps} steps): max relative gradient difference {diff:.2e}")
    assert diff <= 1e-5
    if steps > 1:
        assert want_row["rewards/chosen"] != 0.0  # the policy has left its reference
    for key in ("loss", "rewards/chosen", "rewards/margin", "logps/chosen", "logps/rejected"):
        assert abs(got["row"][key] - want_row[key]) <= 1e-5 * max(1.0, abs(want_row[key])), key
    return plan, got["grads"]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_qlora_dpo_two_ranks_equal_one_process(tmp_path, engine):
    plan, grads = _two_ranks_against_one(tmp_path, QLORA, engine)
    assert plan.reference == ADAPTERS_DISABLED  # no second model: the policy with its adapters off
    assert grads and all(".lora_" in k for k in grads)  # the adapters train, the 4-bit base does not


@pytest.mark.parametrize("method,engine", [("lora", "fsdp"), ("full", "zero3")])
def test_chunked_head_dpo_two_ranks_equal_one_process(tmp_path, method, engine):
    plan, _ = _two_ranks_against_one(tmp_path, CHUNKED[method], engine)
    assert plan.chunked_loss
