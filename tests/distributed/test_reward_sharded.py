"""Reward models trained by the sharding engines and exported (docs/preference.md "Reward models"):
``llmft train`` on 2 ranks, a full fine-tune under FSDP2 (exported streamed from its DCP state) and
LoRA under DeepSpeed ZeRO-3 (merged from its partitions), both on a pretrained causal LM whose new
score head starts from the seeded init; the export loads with ``AutoModelForSequenceClassification``
and scores like the checkpoint (to 1e-5)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ROOT,
    preference_texts,
    pretrained_model,
    reward_scores,
    save_tiny_pretrained,
    torchrun,
    write_recipe,
)

from llmft.export.consolidate import load_checkpoint_model
from llmft.export.export import export

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CASES = {
    "fsdp-full": ["distributed.engine=fsdp", "peft.method=none"],
    "zero3-lora": ["distributed.engine=deepspeed", "distributed.zero_stage=3", "peft.method=lora", "peft.r=4"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_reward_model_exports_and_scores_like_its_checkpoint(tmp_path, case):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((ROOT / "data/preference/train.jsonl").read_text().splitlines(keepends=True)[:40]))
    recipe = write_recipe(
        tmp_path,
        model=pretrained_model(save_tiny_pretrained(tmp_path / "base", seed=3)),
        data__train=str(data),
        train__objective="reward",
        train__max_steps=2,
        checkpoint__every_steps=2,
        batch__micro_batch_size=2,
    )
    done = torchrun(["train", str(recipe), *CASES[case]], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    step = tmp_path / "run/checkpoints/step-2"
    trained, tokenizer, _, _ = load_checkpoint_model(step)
    out = export(step, tmp_path / "export", merge_lora=True)
    exported = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    texts = preference_texts()
    want = reward_scores(trained.eval(), tokenizer, texts)
    got = reward_scores(exported, AutoTokenizer.from_pretrained(out), texts)
    assert want.abs().max() > 0
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
