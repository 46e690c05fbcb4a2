"""A record kind added from outside llmft (tests/documents_kind.py: a kind record, an objective
record and their code in one module, found through ``train.objective_module``) is cached, streamed,
prepared, collated, verified and trained like a built-in one, with no edit inside llmft's data
build, training or planning modules (docs/design.md, "Adding a record kind").
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import max_rel_diff, metrics, train_inproc, write_recipe

from llmft.export.consolidate import load_checkpoint_model, trainable_state

PLUGIN = ["train.objective=doc_lm", "train.objective_module=documents_kind"]
SGD = ["optim.name=sgd", "optim.lr=0.5", "batch.global_batch_size=8"]


def _recipe(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    lines = [{"title": f"note {i}", "body": "abcdefgh"[: 1 + i % 8] * (1 + i % 3)} for i in range(40)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return write_recipe(tmp, data__cache_dir=str(tmp / "cache"), data__packing=True)


def _weights(tmp: Path) -> dict:
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


def test_a_registered_kind_trains_and_any_split_is_the_big_batch(tmp_path):
    """Its rows come from its own encoder (the body's tokens the targets), are never packed (its
    record says so, whatever data.packing), are collated by its own collate (the objective refuses
    a batch without ``documents``), and 4 x 2 accumulation lands on the 8-record batch's weights."""
    assert train_inproc(_recipe(tmp_path / "big"), *PLUGIN, *SGD, "batch.micro_batch_size=8") == 0
    assert train_inproc(_recipe(tmp_path / "split"), *PLUGIN, *SGD, "batch.micro_batch_size=2") == 0
    assert max_rel_diff(_weights(tmp_path / "split"), _weights(tmp_path / "big")) <= 1e-5
    assert len(metrics(tmp_path / "split" / "run")) == 2
    (entry,) = [p for p in (tmp_path / "big" / "cache").iterdir() if p.is_dir()]
    meta = json.loads((entry / "meta.json").read_text())
    assert (meta["parts"]["format"], meta["parts"]["objective"], meta["parts"]["packing"]) == (
        "documents-1",
        "doc_lm",
        None,
    )
    assert meta["stats"]["records"] == meta["stats"]["rows"] == 40  # one row per document, none packed


def test_a_registered_kind_is_prepared_verified_and_streamed(tmp_path, capsys):
    from llmft.data.prepare import prepare
    from llmft.training.verify import verify

    recipe = _recipe(tmp_path)
    report = prepare(str(recipe), PLUGIN)
    assert "40 records -> 40 documents" in report
    assert "train: 40 documents of max_seq_len 64" in report
    assert verify(str(recipe), [*PLUGIN, *SGD, "batch.micro_batch_size=2"]) == 0
    assert "doc_lm" in capsys.readouterr().out
    streamed = ["data.streaming=true", "data.eval_fraction=0", "run.output_dir=" + str(tmp_path / "stream")]
    assert train_inproc(recipe, *PLUGIN, *SGD, "batch.micro_batch_size=4", *streamed) == 0
    assert len(metrics(tmp_path / "stream")) == 2


def test_a_kind_is_refused_under_a_taken_name_or_without_a_cache_format():
    import pytest

    from llmft.errors import UserError
    from llmft.plan.kinds import RecordKind, register_kind

    with pytest.raises(UserError) as e:
        register_kind(RecordKind("pairs", "my pairs", "my_pairs", cache_format="mine-1"))
    assert str(e.value) == (
        "train.objective_module: registers record kind 'pairs', which is registered already "
        "(llmft.data.kinds.pairs). Give the new kind a name of its own."
    )
    with pytest.raises(UserError) as e:
        register_kind(RecordKind("tables", "tables", "my_tables"))
    assert "registers record kind 'tables' without a cache_format" in str(e.value)


def test_an_objective_reading_an_unregistered_kind_is_refused():
    import pytest

    from llmft.errors import UserError
    from llmft.plan.objectives import ObjectiveSpec, register_objective

    with pytest.raises(UserError) as e:
        register_objective(ObjectiveSpec(name="x", title="x", runtime=None, counts="tokens", record="tables"))
    assert (
        "train.objective_module: registers objective 'x' reading 'tables' records. Use one of the record kinds "
        "the data layer reads: sequences, pairs, prompts"
    ) in str(e.value)
    assert "or register the kind first (llmft.plan.kinds.register_kind)." in str(e.value)
