"""docs/recipe.md is generated from the schema and covers every key of the public contract."""

from __future__ import annotations

from pathlib import Path

from llmft.recipe.docs import REGENERATE, render_recipe_docs
from llmft.recipe.schema import iter_fields

RECIPE_DOC = Path(__file__).resolve().parents[2] / "docs" / "recipe.md"

CONTRACT_KEYS = (
    "model.name_or_path",
    "model.config",
    "model.tokenizer",
    "model.dtype",
    "peft.method",
    "model.quantization",
    "data.train",
    "data.shuffle",
    "data.packing",
    "data.max_seq_len",
    "batch.global_batch_size",
    "batch.micro_batch_size",
    "batch.gradient_accumulation_steps",
    "distributed.engine",
    "distributed.zero_stage",
    "optim.name",
    "optim.lr",
    "optim.weight_decay",
    "optim.scheduler",
    "optim.warmup_steps",
    "optim.max_grad_norm",
    "train.max_steps",
    "checkpoint.every_steps",
    "checkpoint.keep_last",
    "checkpoint.resume",
    "run.output_dir",
    "run.seed",
)


def test_recipe_reference_is_fresh():
    rendered = render_recipe_docs()
    committed = RECIPE_DOC.read_text() if RECIPE_DOC.exists() else ""
    assert committed == rendered, f"docs/recipe.md is out of date with llmft/recipe/schema.py; run: {REGENERATE}"


def test_every_contract_key_is_documented():
    text = RECIPE_DOC.read_text()
    missing = [key for key in CONTRACT_KEYS if f"| `{key}` |" not in text]
    assert not missing, f"docs/recipe.md lacks contract keys {missing}; run: {REGENERATE}"


def test_every_schema_key_has_a_row_with_its_choices():
    text = render_recipe_docs()
    for key, f, _ in iter_fields():
        if "." not in key:
            assert f"## `{key}`" in text
            continue
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert row.count(" | ") == 3, row  # no stray pipe breaks the table
        for choice in f.metadata.get("choices") or ():
            shown = "null" if choice is None else str(choice).lower() if isinstance(choice, bool) else choice
            assert f"`{shown}`" in row
    assert "| `batch.micro_batch_size` | int or `auto` | `auto` |" in text
    assert "| `model.quantization` | section or null | `null` |" in text
