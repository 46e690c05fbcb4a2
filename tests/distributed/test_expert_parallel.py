"""Expert parallelism on FSDP2 (llmft/model/expert_parallel.py; docs/moe.md): 2 processes on gloo
under torchrun with ``distributed.expert_parallel: 2``, each holding 4 of the 8 experts of every MoE
layer and dispatching tokens all-to-all, each with 2 of the 4 examples of every step, give after two
steps the gradients (every expert's, gathered whole), the loss, the balancing loss and the expert
load of one process with the whole batch, and of the same run with ``expert_parallel: 1``; for tiny
``qwen3_moe``, ``mixtral`` (activation checkpointing) and ``gpt_oss`` (transposed experts with
biases), and under AdamW with gradient clipping (the experts' norm joins FSDP2's). ``llmft train``
from a pretrained directory (each rank reads only its experts' rows), checkpointed with the experts
split, resumes with ``expert_parallel: 1`` onto the weights of an unsplit run, and exports a model
transformers loads.

This file is also the probe that torchrun runs on each rank (``test_moe_ranks.run_variants``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, the step harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the examples and the tiny families

from helpers import ROOT, save_tiny_pretrained, torchrun, write_recipe  # noqa: E402
from preference_batches import preference_step  # noqa: E402
from test_aux_loss import GLOBAL  # noqa: E402
from test_moe import FAMILIES, max_abs_diff  # noqa: E402
from test_moe_ranks import ROWS, STEPS, _steps, family_overrides, launch, run_variants  # noqa: E402

pytestmark = pytest.mark.distributed

COMMON = [f"batch.global_batch_size={GLOBAL}", "optim.name=sgd", "optim.lr=0.5", "optim.max_grad_norm=null"]
EP2 = ["moe.aux_loss_coef=0.5", "distributed.expert_parallel=2"]
VARIANTS = {
    "qwen3_moe": EP2,
    "qwen3_moe-ep1": ["moe.aux_loss_coef=0.5", "distributed.expert_parallel=1"],
    "mixtral-checkpointing": [*EP2, "model.gradient_checkpointing=true"],
    "gpt_oss": EP2,
    "qwen3_moe-adamw": [*EP2, "optim.name=adamw", "optim.lr=0.01", "optim.max_grad_norm=0.5"],
}


def _overrides(variant: str) -> list[str]:
    return family_overrides(VARIANTS, variant)


def _one_process(tmp: Path, variant: str):
    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    over = [*COMMON, *_overrides(variant), f"batch.micro_batch_size={GLOBAL}", "distributed.engine=single"]
    over = [o for o in over if not o.startswith("distributed.expert_parallel")]
    plan = resolve(load_recipe(write_recipe(tmp), over))
    return preference_step(plan, DistEnv(), _steps(GLOBAL), steps=STEPS)


@pytest.mark.slow
def test_experts_on_two_ranks_equal_one_process_and_expert_parallel_1(tmp_path):
    keys = [*COMMON, "distributed.engine=fsdp", "batch.micro_batch_size=1"]  # ranks x accumulation 2
    got = launch(__file__, tmp_path, [json.dumps(list(VARIANTS))], keys)
    for variant in VARIANTS:
        want_grads, want_row = _one_process(tmp_path / f"one-{variant}", variant)
        diff = max_abs_diff(got[variant]["grads"], want_grads)
        print(f"{variant}: step {STEPS} gradients differ from one process by {diff:.2e}")
        assert diff <= 1e-5, (variant, diff)
        assert any(".experts." in name for name in got[variant]["grads"])
        for key in ROWS:
            assert got[variant]["row"][key] == pytest.approx(want_row[key], rel=1e-5), (variant, key)
    ep1 = max_abs_diff(got["qwen3_moe"]["grads"], got["qwen3_moe-ep1"]["grads"])
    print(f"expert_parallel 2 vs 1: {ep1:.2e}")
    assert ep1 <= 1e-5


def _train(recipe: Path, *keys: str) -> str:
    done = torchrun(["train", str(recipe), *keys], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from llmft.export.consolidate import load_checkpoint_model

    model = load_checkpoint_model(run)[0]
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_train_resume_with_other_expert_parallel_and_export(tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    base = save_tiny_pretrained(tmp_path / "base", seed=3, **FAMILIES["qwen3_moe"])
    model = {"name_or_path": str(base), "dtype": "fp32", "attn_implementation": "eager"}
    keys = ["distributed.engine=fsdp", "batch.micro_batch_size=2", "moe.aux_loss_coef=0.5", "checkpoint.every_steps=2"]
    recipe = write_recipe(tmp_path, model=model, train__max_steps=4)
    run = {name: tmp_path / name for name in ("split", "whole", "resumed")}
    out = {name: f"run.output_dir={path}" for name, path in run.items()}
    said = _train(recipe, *keys, out["split"], "distributed.expert_parallel=2", "train.max_steps=2")
    assert (
        "batch: micro 2 x accumulation 2 x data-parallel 2 = global 8 (expert-parallel 2 within data-parallel 2)"
        in said
    )
    assert (
        "expert parallel: experts 0-3 of 8 on this rank in each of 2 MoE layers, tokens all-to-all over 2 ranks" in said
    )
    shutil.copytree(run["split"], run["resumed"])
    _train(recipe, *keys, out["split"], "distributed.expert_parallel=2")  # resumed with the experts split
    _train(recipe, *keys, out["resumed"], "distributed.expert_parallel=1")  # resumed with every expert on every rank
    _train(recipe, *keys, out["whole"], "distributed.expert_parallel=1")
    want = _weights(run["whole"])
    for name in ("split", "resumed"):
        diff = max_abs_diff(_weights(run[name]), want)
        print(f"{name}: final weights differ from the unsplit run by {diff:.2e}")
        assert diff <= 1e-5, (name, diff)

    exported = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "export", str(run["split"]), "--out", str(exported)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert max_abs_diff({k: v.float() for k, v in loaded.state_dict().items()}, _weights(run["split"])) == 0


def main(recipe: str, out: str, names: str, *overrides: str) -> None:
    run_variants(recipe, out, VARIANTS, json.loads(names), *overrides)


if __name__ == "__main__":
    main(*sys.argv[1:])


@pytest.mark.slow
def test_grpo_generation_and_eval_with_experts_split(tmp_path):
    """Online RL with expert parallelism: ``generate`` on FSDP2 with the experts on 2 ranks, sampled
    completions ending at different lengths on each rank (every rank joins every forward, so every
    MoE layer's all-to-all), a held-out greedy eval, the routing pre-pass and the update; the file
    rollouts' run lands on the weights of the same run with ``expert_parallel: 1``."""
    from grpo_runs import grpo_recipe, rewards_importable
    from helpers import metrics

    save_tiny_pretrained(tmp_path / "grpo-model", seed=1, **FAMILIES["qwen3_moe"])
    keys = ["distributed.engine=fsdp", "batch.micro_batch_size=2", "moe.aux_loss_coef=0.5", "train.eval_every_steps=1"]
    recipe = grpo_recipe(tmp_path / "hf", rollout__backend="hf", rollout__max_new_tokens=12, data__eval_fraction=0.25)
    done = torchrun(
        ["train", str(recipe), *keys, "distributed.expert_parallel=2"], env=rewards_importable(), timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = metrics(tmp_path / "hf" / "run")
    assert len(rows) == 2 and all(r["generation_s"] > 0 and 1 <= r["completion_length"] <= 12 for r in rows)
    assert metrics(tmp_path / "hf" / "run", split="eval")[-1]["prompts"] == 3
    weights = {}
    for n in (2, 1):
        recipe = grpo_recipe(tmp_path / f"file-{n}")
        done = torchrun(["train", str(recipe), *keys[:3], f"distributed.expert_parallel={n}"], env=rewards_importable())
        assert done.returncode == 0, done.stderr[-4000:]
        weights[n] = _weights(tmp_path / f"file-{n}" / "run")
    assert max_abs_diff(weights[2], weights[1]) <= 1e-5
