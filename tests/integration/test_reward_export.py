"""Reward models end to end (``train.objective: reward``, docs/preference.md "Reward models"):
``llmft train`` on the shipped preference pairs, then ``llmft export``: the exported dir loads with
``AutoModelForSequenceClassification`` and scores pairs as the checkpoint does (to 1e-5), for a
LoRA adapter merged into a pretrained causal-LM base (the score head is new, trained and saved
with the adapter; and the adapter export loaded with PEFT's ``AutoPeftModelForSequenceClassification``)
and for a full fine-tune of a fresh ``model.config`` model; the model card names the objective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    ROOT,
    TINY_LLAMA,
    metrics,
    preference_texts,
    pretrained_model,
    reward_scores,
    save_tiny_pretrained,
    train_inproc,
)

from llmft.export.consolidate import load_checkpoint_model
from llmft.export.export import export

PAIRS = ROOT / "data/preference/train.jsonl"


def _recipe(tmp: Path, model: dict, method: str) -> Path:
    data = tmp / "pairs.jsonl"
    data.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:40]))
    recipe = {
        "run": {"output_dir": str(tmp / "run"), "seed": 0, "tensorboard": False},
        "model": model,
        "peft": {"method": method, "r": 4},
        "data": {"train": str(data), "max_seq_len": 64, "num_workers": 0, "eval_fraction": 0.1},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"name": "adamw", "lr": 1e-2, "scheduler": "constant"},
        "train": {"objective": "reward", "max_steps": 3, "progress_bar": False, "eval_every_steps": 3},
        "checkpoint": {"every_steps": 3},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("method", ["lora", "none"])
def test_exported_reward_model_scores_like_the_checkpoint(tmp_path, method):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if method == "lora":  # a pretrained causal LM: its checkpoint has no score head
        model = pretrained_model(save_tiny_pretrained(tmp_path / "base", seed=3))
    else:  # a fresh model.config model
        model = {"config": TINY_LLAMA, "dtype": "fp32", "attn_implementation": "eager"}
    recipe = _recipe(tmp_path, model, method)
    assert train_inproc(recipe) == 0
    run = tmp_path / "run"
    rows = metrics(run)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"} <= set(rows[-1])
    assert "logps/chosen" not in rows[-1]  # a score head predicts no tokens
    assert {"rewards/accuracy", "loss"} <= set(metrics(run, "eval")[-1])

    step = run / "checkpoints/step-3"
    trained, tokenizer, _, _ = load_checkpoint_model(step)
    trained.eval()
    out = export(step, tmp_path / "export", merge_lora=True)
    exported = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert exported.config.num_labels == 1 and exported.config.pad_token_id == tokenizer.pad_token_id
    texts = preference_texts()
    want = reward_scores(trained, tokenizer, texts)
    got = reward_scores(exported, AutoTokenizer.from_pretrained(out), texts)
    assert want.abs().max() > 0
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    if method == "lora":  # the head is trained and saved with the adapter, not left at its init
        from peft import AutoPeftModelForSequenceClassification

        adapter = json.loads((step / "model/adapter_config.json").read_text())
        assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
        # the adapter export, as the model card shows it; an adapter dir has no config: the pad token is set here
        peft_model = AutoPeftModelForSequenceClassification.from_pretrained(
            export(step, tmp_path / "adapter"), num_labels=1
        ).eval()
        peft_model.config.pad_token_id = tokenizer.pad_token_id
        got = reward_scores(peft_model, tokenizer, texts)
        assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))

    card = (out / "README.md").read_text()
    assert "| objective | reward (a scalar score head, loss -log sigmoid(r_chosen - r_rejected) per pair) |" in card
    assert "pipeline_tag: text-classification" in card and "AutoModelForSequenceClassification" in card
