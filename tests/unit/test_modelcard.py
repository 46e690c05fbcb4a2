"""``llmft export`` writes a README.md model card the hub reads (read back with huggingface_hub's
own ModelCard), records the export path on the tracked run, and ``--push-to-hub`` goes as far as
the hub call (no network here: HF_HUB_OFFLINE makes huggingface_hub refuse it, which must be a
clean user error with the export left complete)."""

from __future__ import annotations

from llmft.modelcard import _base_license, card_facts, render


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
