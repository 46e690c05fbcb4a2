"""LoRA on the fused expert weights over ranks (llmft/model/adapters.py; docs/moe.md): 2 processes on
gloo under torchrun on DDP, FSDP2, ZeRO-2 and ZeRO-3, each with 2 of the 4 examples of every step
(micro 1 x accumulation 2), give after two SGD steps the gradients (of the experts' LoRA, the other
layers' LoRA, and the router trained in full with ``peft.train_router``) and the logged loss,
balancing loss and expert load of one process with the whole batch, the balancing loss on (weight
0.5). Equal step-2 gradients from equal step-1 weights: equal weights after both steps.

ZeRO-3 partitions the fused ``[experts, ., .]`` weights and their LoRA factors like any other weight;
PEFT's ``ParamWrapper`` reads them (gathering them) in its own forward, whatever the routing. The
ranks' micro-batches route differently: at some micro-step a layer's expert gets no token on one
rank and some on the other (checked here), and the run must neither hang nor differ.

This file is also the probe that torchrun runs on each rank: ``python test_moe_lora_ranks.py RECIPE
OUT_FILE [KEY=VALUE ...]``; rank 0 writes {variant: {"grads": ..., "row": ...}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, the step harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the examples and the tiny families

from helpers import TWO_RANK_ENGINES, write_recipe  # noqa: E402
from preference_batches import preference_step  # noqa: E402
from test_aux_loss import GLOBAL  # noqa: E402
from test_moe import max_abs_diff  # noqa: E402
from test_moe_ranks import ROWS, STEPS, _steps, family_overrides, launch, run_variants  # noqa: E402

pytestmark = pytest.mark.distributed

COMMON = [
    f"batch.global_batch_size={GLOBAL}",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.max_grad_norm=null",
    "peft.method=lora",
    "peft.r=4",
    "peft.alpha=8",
    "moe.aux_loss_coef=0.5",
]
VARIANTS = {"qwen3_moe": [], "mixtral-router": ["peft.train_router=true"]}


def _overrides(variant: str) -> list[str]:
    return family_overrides(VARIANTS, variant)


def _plan(tmp: Path, variant: str):
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    over = [*COMMON, *_overrides(variant), f"batch.micro_batch_size={GLOBAL}", "distributed.engine=single"]
    return resolve(load_recipe(write_recipe(tmp), over))


@torch.no_grad()
def empty_experts(plan, micro: list[dict]) -> list[torch.Tensor]:
    """Per micro-batch, ``[layers, experts]``: True where a layer routes no token of it to an expert
    (the model at its initial weights: LoRA's B is zero, so the base model's routing)."""
    from llmft.data.tokenizer import load_tokenizer
    from llmft.model.build import build_model

    model = build_model(plan.recipe, load_tokenizer(plan.recipe.model)).eval()
    top_k = model.config.num_experts_per_tok
    out = []
    for mb in micro:
        inputs = {k: mb[k] for k in ("input_ids", "attention_mask") if k in mb}
        logits = model(**inputs, output_router_logits=True).router_logits
        out.append(
            torch.stack([torch.bincount(x.topk(top_k).indices.flatten(), minlength=x.shape[-1]) == 0 for x in logits])
        )
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from llmft.job.dist import DistEnv

    out = {}
    for variant in VARIANTS:
        plan = _plan(tmp_path_factory.mktemp(f"one-{variant}"), variant)
        want_grads, want_row = preference_step(plan, DistEnv(), _steps(GLOBAL), steps=STEPS)
        experts = [n for n in want_grads if ".experts." in n and "lora_A" in n]
        assert len(experts) == 4 and all(want_grads[n].abs().max() > 0 for n in experts)  # they train
        routers = [n for n in want_grads if ".mlp.gate." in n]
        assert bool(routers) == variant.endswith("router")
        assert want_row["aux/moe_balance"] > 0.1 * want_row["loss"]
        # At some micro-step the two ranks' micro-batches leave different experts without a token.
        rank0, rank1 = (empty_experts(plan, _steps(1, rank, 2)[: GLOBAL // 2]) for rank in range(2))
        assert any((a ^ b).any() for a, b in zip(rank0, rank1, strict=True)), variant
        out[variant] = want_grads, want_row
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(TWO_RANK_ENGINES))
def test_two_ranks_equal_one_process_with_lora_on_the_experts(tmp_path, one_process, engine):
    keys = [*COMMON, *TWO_RANK_ENGINES[engine], "batch.micro_batch_size=1"]  # ranks x accumulation 2
    got = launch(__file__, tmp_path, [], keys)
    for variant, (want_grads, want_row) in one_process.items():
        diff = max_abs_diff(got[variant]["grads"], want_grads)
        print(f"{engine} {variant}: step {STEPS} gradients differ by {diff:.2e}")
        assert diff <= 1e-5, (variant, diff)
        for key in ROWS:
            assert got[variant]["row"][key] == pytest.approx(want_row[key], rel=1e-5), (variant, key)


def main(recipe: str, out: str, *overrides: str) -> None:
    run_variants(recipe, out, VARIANTS, list(VARIANTS), *overrides)


if __name__ == "__main__":
    main(*sys.argv[1:])
