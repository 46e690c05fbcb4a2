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


# Words of a development log, not of a user page: user docs say how to use the tool and what it
# guarantees, with measured numbers and how to reproduce them (docs/design.md and the contributor
# pages may tell history).
DEV_LOG = (
    "Done:",
    "Also done:",
    "Not done yet",
    "this session",
    "the session that",
    "while writing",
    "time of writing",
    "as of this writing",
    "this page was written",
    "closing note",
    "as it stood",
    "TODO",
    "FIXME",
)
DOCS = RECIPE_DOC.parent


def user_pages() -> list[Path]:
    return [p for p in sorted(DOCS.glob("*.md")) if p.name != "design.md"] + [DOCS.parent / "README.md"]


def dev_log_lines(path: Path) -> list[str]:
    found = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        words = [w for w in DEV_LOG if (w in line if w[0].isupper() else w in line.lower())]
        if words:
            found.append(f"{path.name}:{n}: {words}: {line.strip()[:100]}")
    return found


def test_user_docs_carry_no_development_log():
    found = [hit for page in user_pages() for hit in dev_log_lines(page)]
    assert not found, "user docs say how to use llmft and what it guarantees, not how a page was written:\n" + (
        "\n".join(found)
    )


def test_the_development_log_check_finds_the_words(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Fine.\nDone: the loader.\nNot done yet:\nMeasured in this session at 11:01.\n")
    assert [hit.split(":")[1] for hit in dev_log_lines(page)] == ["2", "3", "4"]
