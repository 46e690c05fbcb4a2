"""The sampler's log-probs against the trainer's (``rl.importance_correction: tis``; docs/rl.md):
generation returns each completion token's log-prob under the sampler, the trainer's old log-probs
are computed for the same tokens, each token's policy term is weighted by min(exp(old - sampler),
rl.is_cap) (TRL's ``vllm_importance_sampling_mode: token_truncate``), and the mismatch is logged.

The weights are checked by their effect on one plain-SGD step: with the sampler's log-probs moved by
a constant, every weight is the same number c and the step is c times the uncorrected one (c
below the cap, and the cap itself above it). The correction keeps any split the big batch, and a
resume inside a generation batch (``rl.iterations: 2``) reads the kept weights back."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_runs import grpo_recipe, rewards_importable
from helpers import metrics, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state
from llmft.model.generate import HFGenerator
from llmft.plan.resolve import load_plan
from llmft.recipe.load import RecipeError

HF = {"rollout__backend": "hf", "rollout__max_new_tokens": 8}
TIS = "rl.importance_correction=tis"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    for path in rewards_importable()["PYTHONPATH"].split(":"):
        if path:
            monkeypatch.syspath_prepend(path)


def _weights(run) -> dict[str, torch.Tensor]:
    return trainable_state(load_checkpoint_model(run)[0])


def _initial(tmp_path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "grpo-model", dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _step(tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    """The first SGD step's weight change (lr 0.5, no clipping: -0.5 x the gradient)."""
    recipe = grpo_recipe(tmp_path / name, **HF)
    assert train_inproc(recipe, "train.max_steps=1", *overrides) == 0
    after, before = _weights(tmp_path / name / "run"), _initial(tmp_path)
    return {k: after[k] - before[k] for k in after}


def _shifted_sampler(monkeypatch, shift: float) -> None:
    """The sampler's log-probs moved by ``shift`` (every token's weight becomes exp(-shift), capped)."""
    sample = HFGenerator.sample

    def moved(self, prompts, how):
        ids, logps = sample(self, prompts, how)
        return ids, [[v + shift for v in row] for row in logps]

    monkeypatch.setattr(HFGenerator, "sample", moved)


@pytest.mark.parametrize("shift,weight", [(0.5, math.exp(-0.5)), (-2.0, 3.0)])
def test_each_token_is_weighted_by_the_truncated_ratio(tmp_path, monkeypatch, shift, weight):
    plain = _step(tmp_path, "plain")
    _shifted_sampler(monkeypatch, shift)
    corrected = _step(tmp_path, "tis", TIS)
    moved = [k for k in plain if plain[k].abs().max() > 1e-6]
    assert moved
    for k in moved:  # relative to the step (its smallest entries are at fp32's resolution of the weights)
        assert float((corrected[k] - weight * plain[k]).norm() / (weight * plain[k]).norm()) <= 1e-4, k
    (row,) = metrics(tmp_path / "tis" / "run")
    assert row["mismatch/logp_abs_mean"] == pytest.approx(abs(shift), rel=1e-4)
    assert row["mismatch/is_weight_mean"] == pytest.approx(weight, rel=1e-4)
    assert row["mismatch/capped_fraction"] == (1.0 if weight == 3.0 else 0.0)
    ratio = math.exp(-shift)
    assert row["mismatch/kl"] == pytest.approx(ratio + shift - 1, rel=1e-3)


def test_generate_and_the_trainer_agree_and_any_split_is_the_big_batch(tmp_path):
    """The hf backend samples from the trainer's own weights: its log-probs differ only by the
    numerics of the KV-cached, left-padded forward (logged); micro 2 x accumulation 4 lands on micro 8."""
    runs = {}
    for micro in (8, 2):
        recipe = grpo_recipe(tmp_path / f"m{micro}", **HF)
        assert train_inproc(recipe, TIS, f"batch.micro_batch_size={micro}") == 0
        runs[micro] = _weights(tmp_path / f"m{micro}" / "run")
    assert max(float((runs[2][k] - runs[8][k]).abs().max()) for k in runs[8]) <= 1e-5
    rows = metrics(tmp_path / "m8" / "run")
    assert len(rows) == 2
    for row in rows:
        print({k: v for k, v in row.items() if k.startswith("mismatch/")})
        assert 0 <= row["mismatch/logp_abs_max"] <= 1e-4
        assert row["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_a_resume_inside_a_generation_batch_keeps_the_weights(tmp_path):
    over = [TIS, "rl.iterations=2", "batch.micro_batch_size=4"]
    whole = tmp_path / "whole"
    assert train_inproc(grpo_recipe(whole, **HF), *over, "train.max_steps=4") == 0
    cut = tmp_path / "cut"
    recipe = grpo_recipe(cut, **HF)
    assert train_inproc(recipe, *over, "train.max_steps=3", "checkpoint.every_steps=1") == 0
    state = torch.load(cut / "run/checkpoints/step-3/objective/rank-0.pt", weights_only=True)
    assert len(state["is_weights"]) == len(state["completions"]) == 8
    assert train_inproc(recipe, *over, "train.max_steps=4") == 0
    a, b = _weights(cut / "run"), _weights(whole / "run")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_tis_without_the_samplers_log_probs_is_refused(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_plan(grpo_recipe(tmp_path), [TIS])
    assert (
        "rl.importance_correction: is tis, but rollout.backend is file: a file's completions come without the "
        "sampler's log-probs. Set rl.importance_correction=none, or generate with rollout.backend=hf or vllm."
    ) in str(e.value)
