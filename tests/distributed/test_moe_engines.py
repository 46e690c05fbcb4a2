"""Mixture-of-experts families on the engines the other MoE probes leave out (docs/moe.md): 2
processes on gloo under torchrun, each with 2 of the 4 examples of every step, give after two SGD
steps one process's big-batch gradients and loss within 1e-5 for a tiny ``deepseek_v3`` (latent
attention, a shared expert, a dense first layer, routing balanced without a loss: no balancing
term), full and with LoRA on its experts, on ZeRO-1, FSDP2 and ZeRO-3; and ``qwen3_moe`` with the
balancing loss on ZeRO-1. QLoRA on a mixture of experts trains with ``llmft train`` under FSDP2
(4-bit experts) and ZeRO-3 (the experts kept in ``model.dtype``).

This file is also the probe torchrun runs on each rank (``test_moe_ranks.run_variants``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, the step harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the examples and the tiny families

from helpers import metrics, torchrun, write_recipe  # noqa: E402
from preference_batches import preference_step  # noqa: E402
from test_aux_loss import GLOBAL  # noqa: E402
from test_moe import FAMILIES, max_abs_diff  # noqa: E402
from test_moe_ranks import STEPS, _steps, family_overrides, launch, run_variants  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = [f"batch.global_batch_size={GLOBAL}", "optim.name=sgd", "optim.lr=0.5", "optim.max_grad_norm=null"]
LORA = ["peft.method=lora", "peft.r=4", "peft.alpha=8", "peft.dropout=0"]
VARIANTS = {"deepseek_v3": [], "deepseek_v3-lora": LORA, "qwen3_moe": ["moe.aux_loss_coef=0.5"]}
ENGINES = {
    "zero1": (
        ["distributed.engine=deepspeed", "distributed.zero_stage=1"],
        ["deepseek_v3", "deepseek_v3-lora", "qwen3_moe"],
    ),
    "fsdp": (["distributed.engine=fsdp"], ["deepseek_v3", "deepseek_v3-lora"]),
    "zero3": (["distributed.engine=deepspeed", "distributed.zero_stage=3"], ["deepseek_v3", "deepseek_v3-lora"]),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    out = {}
    for variant in VARIANTS:
        tmp = tmp_path_factory.mktemp(f"one-{variant}")
        over = [*COMMON, *family_overrides(VARIANTS, variant), f"batch.micro_batch_size={GLOBAL}"]
        plan = resolve(load_recipe(write_recipe(tmp), [*over, "distributed.engine=single"]))
        out[variant] = preference_step(plan, DistEnv(), _steps(GLOBAL), steps=STEPS)
    return out


# CI: ZeRO-1 and ZeRO-3 (the engines the other MoE probes leave out); -m extended: FSDP2 too
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.extended) if e == "fsdp" else e for e in ENGINES])
def test_two_ranks_equal_one_process_big_batch(tmp_path, one_process, engine):
    keys, names = ENGINES[engine]
    got = launch(__file__, tmp_path, [json.dumps(names)], [*COMMON, *keys, "batch.micro_batch_size=1"])
    for variant in names:
        want_grads, want_row = one_process[variant]
        diff = max_abs_diff(got[variant]["grads"], want_grads)
        print(f"{engine} {variant}: step {STEPS} gradients differ by {diff:.2e}")
        assert diff <= 1e-5, (variant, diff)
        assert any(".experts." in name for name in want_grads)  # the experts (or their LoRA) were trained
        assert got[variant]["row"]["loss"] == pytest.approx(want_row["loss"], rel=1e-5)


QLORA_ENGINES = {
    "fsdp": (["distributed.engine=fsdp"], "experts: gate_up_proj, down_proj of 2 MoE layers in 4 bits"),
    "zero3": (
        ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
        "experts: gate_up_proj, down_proj of 2 MoE layers in 4 bits",
    ),
}


@pytest.mark.parametrize("engine", list(QLORA_ENGINES))
def test_qlora_on_a_mixture_of_experts_trains(tmp_path, engine):
    """FSDP2 and ZeRO-3 pack the experts in 4 bits (tests/distributed/test_moe_quant_fsdp.py and
    test_moe_quant_zero.py prove it exact), and say so."""
    keys, said = QLORA_ENGINES[engine]
    config = {**FAMILIES["qwen3_moe"], "hidden_size": 64, "head_dim": 16, "moe_intermediate_size": 64}
    recipe = write_recipe(tmp_path, model__config=config, train__max_steps=3)
    keys = [*keys, "batch.micro_batch_size=2", "model.quantization={bits: 4}", *LORA, "moe.aux_loss_coef=0.5"]
    done = torchrun(["train", str(recipe), *keys], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert said in done.stdout + done.stderr
    rows = metrics(tmp_path / "run")
    assert len(rows) == 3 and all(r["aux/moe_balance"] > 0 for r in rows)


def main(recipe: str, out: str, names: str, *overrides: str) -> None:
    run_variants(recipe, out, VARIANTS, json.loads(names), *overrides)


if __name__ == "__main__":
    main(*sys.argv[1:])
