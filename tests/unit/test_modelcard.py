"""``llmft export`` writes a README.md model card the hub reads (read back with huggingface_hub's
own ModelCard), records the export path on the tracked run, and ``--push-to-hub`` goes as far as
the hub call (no network here: HF_HUB_OFFLINE makes huggingface_hub refuse it, which must be a
clean user error with the export left complete)."""

from __future__ import annotations

from llmft.export.modelcard import _base_license, card_facts, render


def test_hub_base_and_license_go_to_the_front_matter(lora_run, tmp_path):
    from huggingface_hub import ModelCard

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: llama3.1\n---\n# a base model\n")
    assert _base_license(str(base), None) == "llama3.1"
    assert _base_license("nobody/not-cached", None) is None  # never fetched

    out = tmp_path / "card"
    out.mkdir()
    facts = card_facts(lora_run / "checkpoints/step-3", out)
    assert facts["adapter"] is False  # no adapter_config.json in out: a merged / full export
    facts.update(
        base="meta-llama/Llama-3.1-8B",
        base_is_hub_id=True,
        license="llama3.1",
        quantization={"bits": 4, "quant_type": "nf4", "double_quant": True},
        data=["HuggingFaceH4/ultrachat_200k", "data/mine.jsonl"],
    )
    (out / "README.md").write_text(render(facts))
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "meta-llama/Llama-3.1-8B" and data["license"] == "llama3.1"
    assert data["library_name"] == "transformers" and "qlora" in data["tags"]
    assert data["datasets"] == ["HuggingFaceH4/ultrachat_200k"]  # local files are not hub datasets
    assert "| method | QLoRA (lora on a 4-bit nf4 base) |" in card.text
    assert "| export | full model (merged) |" in card.text


def test_the_card_lists_the_objective(lora_run, tmp_path):
    """sft, dpo with its loss_type and beta, reward (a sequence classifier: its pipeline and loader)."""
    import copy

    from huggingface_hub import ModelCard

    facts = card_facts(lora_run / "checkpoints/step-3", tmp_path)
    assert facts["objective"] == "sft"
    assert "| objective | sft (next-token loss on the target tokens) |" in render(facts)
    cases = {
        ("dpo", "sigmoid"): "| objective | dpo, loss_type sigmoid, beta 0.1 |",
        ("dpo", "simpo"): "| objective | dpo, loss_type simpo, beta 0.1, simpo_gamma 0.5 |",
        (
            "reward",
            "sigmoid",
        ): "| objective | reward (a scalar score head, loss -log sigmoid(r_chosen - r_rejected) per pair) |",
    }
    for (objective, loss_type), row in cases.items():
        f = copy.deepcopy(facts)
        f["objective"] = f["recipe"]["train"]["objective"] = objective
        f["recipe"]["preference"]["loss_type"] = loss_type
        (tmp_path / "README.md").write_text(render(f))
        card = ModelCard.load(tmp_path / "README.md")
        assert row in card.text
        assert objective in card.data.to_dict()["tags"]
        scorer = objective == "reward"
        assert card.data.to_dict()["pipeline_tag"] == ("text-classification" if scorer else "text-generation")
        assert ("AutoModelForSequenceClassification" in card.text) == scorer
    f["adapter"] = True  # a reward adapter: PEFT's sequence-classification loader, one label
    assert 'AutoPeftModelForSequenceClassification.from_pretrained("THIS_DIR_OR_REPO", num_labels=1)' in render(f)
