"""Record fields: numbers an objective declares (``ObjectiveSpec.fields``) go from each record through
tokenize -> pack -> cache (or the stream) -> collate into the micro-batch, one per token; a record
without one is an error at its file:line; the cache key names them (docs/data.md "Record fields")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import default_recipe, write_jsonl

from llmft.data import build_data
from llmft.data.cache import read_meta
from llmft.data.loader import collate
from llmft.data.sequence import sequence_slice
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.plan import objectives
from llmft.plan.objectives import PAIRS, ObjectiveSpec, register_objective

PROBE = ObjectiveSpec(
    name="fields_probe",
    title="record fields probe",
    runtime="llmft.objectives.sft:SFTObjective",
    counts="tokens",
    fields=("weight", "score"),
)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """PROBE registered for this module's tests only (other tests list the registered names)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(objectives, "_BY_NAME", dict(objectives._BY_NAME))
        register_objective(PROBE)
        yield


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _records(n: int = 12) -> list[dict]:
    """Record i: the letter ``'a' + i`` repeated (lengths 3..16), weight i, score -i / 2."""
    return [{"text": chr(97 + i) * (3 + (5 * i) % 14), "weight": i, "score": -i / 2} for i in range(n)]


def _recipe(tmp_path, objective="fields_probe", **data):
    path = tmp_path / "train.jsonl"
    if not path.exists():
        write_jsonl(path, _records())
    r = default_recipe(path, objective, max_seq_len=32, cache_dir=str(tmp_path / "cache"), shuffle=False, **data)
    r.train.max_steps = 1  # a stream's length is unknown
    r.data.eval_fraction = 0.0
    return r


def _check_rows(ds, n: int) -> None:
    """Every token carries its record's numbers; a packed row's padded tail carries 0."""
    seen = set()
    for r in range(n):
        item = ds[r]
        ids, weight, score = item["input_ids"], item["fields"]["weight"], item["fields"]["score"]
        assert len(weight) == len(ids) == len(score)
        pos = item["position_ids"] if item["position_ids"] is not None else np.arange(len(ids))
        starts = list(np.flatnonzero(pos == 0)) + [len(ids)]
        for lo, hi in zip(starts[:-1], starts[1:], strict=True):
            letters = ids[lo:hi][ids[lo:hi] < 256]
            if len(letters) == 0:  # a padded tail
                assert (weight[lo:hi] == 0).all() and (score[lo:hi] == 0).all()
                continue
            i = int(letters[0]) - 97
            seen.add(i)
            assert (weight[lo:hi] == i).all() and (score[lo:hi] == -i / 2).all()
    assert seen == set(range(12))


@pytest.mark.parametrize("packing", [False, True])
def test_each_token_carries_its_records_fields_through_the_cache(tmp_path, tok, packing):
    bundle = build_data(_recipe(tmp_path, packing=packing), tok)
    _check_rows(bundle.train, len(bundle.train))
    again = build_data(_recipe(tmp_path, packing=packing), tok)  # reopened from the cache entry
    assert not any(e["built"] for e in again.entries)
    _check_rows(again.train, len(again.train))
    batch = collate([again.train[0], again.train[1]], tok.pad_token_id)
    n0 = len(again.train[0]["input_ids"])
    assert batch["weight"].dtype == torch.float32 and batch["weight"].shape == batch["input_ids"].shape
    assert batch["weight"][0, :n0].tolist() == again.train[0]["fields"]["weight"].tolist()
    assert (batch["weight"][0, n0:] == 0).all()  # padding carries no weight


@pytest.mark.parametrize("packing", [False, True])
def test_streamed_rows_carry_the_cached_fields(tmp_path, tok, packing):
    cached = build_data(_recipe(tmp_path, packing=packing), tok).train
    stream = build_data(_recipe(tmp_path, packing=packing, streaming=True, stream_block=100), tok).train
    for p in range(len(cached)):
        assert stream[p]["input_ids"].tolist() == cached[p]["input_ids"].tolist()
        for name in ("weight", "score"):
            assert stream[p]["fields"][name].tolist() == cached[p]["fields"][name].tolist()


def test_the_cache_key_names_the_fields_and_objectives_without_fields_are_unchanged(tmp_path, tok):
    with_fields = build_data(_recipe(tmp_path), tok)
    plain = build_data(_recipe(tmp_path, objective="sft"), tok)  # same data and settings, no fields
    assert plain.entries[0]["built"] and plain.entries[0]["entry"] != with_fields.entries[0]["entry"]
    sft = read_meta(Path(plain.entries[0]["entry"]))["parts"]
    assert "fields" not in sft  # an objective without fields: the key's parts as they were
    assert read_meta(Path(with_fields.entries[0]["entry"]))["parts"] == {**sft, "fields": ["weight", "score"]}
    assert "fields" not in plain.train[0]
    assert set(collate([plain.train[0]], tok.pad_token_id)) == {"input_ids", "labels", "attention_mask"}
    assert [plain.train[i]["input_ids"].tolist() for i in range(len(plain.train))] == [
        with_fields.train[i]["input_ids"].tolist() for i in range(len(with_fields.train))
    ]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_record_without_a_declared_field_names_its_line_and_the_field(tmp_path, tok, streaming):
    records = _records()
    del records[4]["score"]
    records[7]["weight"] = "heavy"
    write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(UserError) as e:
        build_data(_recipe(tmp_path, streaming=streaming, stream_block=100), tok).train[0]  # a stream reads here
    assert "train.jsonl:5" in str(e.value) and "has no field 'score' (a number)" in str(e.value)
    skipped = build_data(_recipe(tmp_path, on_bad_record="skip"), tok)
    assert skipped.stats["skipped"] == 2
    write_jsonl(tmp_path / "train.jsonl", [r for k, r in enumerate(records) if k != 4])
    with pytest.raises(UserError, match=r"train.jsonl:7.*field 'weight' is a string, not a finite number"):
        build_data(_recipe(tmp_path), tok)


def test_sequence_parallel_slices_carry_their_tokens_fields():
    batch = {
        "input_ids": torch.arange(10).reshape(2, 5),
        "labels": torch.arange(10).reshape(2, 5),
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
        "weight": torch.arange(10, dtype=torch.float32).reshape(2, 5) + 1,
    }
    parts = [sequence_slice(batch, r, 2) for r in range(2)]
    assert torch.cat([p["weight"] for p in parts], dim=1).tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 0]]


def test_a_field_must_be_a_name_of_its_own_on_sequences_records():
    spec = dict(title="t", runtime="m:O", counts="tokens")
    with pytest.raises(UserError, match="record fields are read from sequences records only"):
        register_objective(ObjectiveSpec(name="fields_pairs", record=PAIRS, fields=("weight",), **spec))
    with pytest.raises(UserError, match=r"with fields 'labels', 'a b'.*none of the micro-batch's keys"):
        register_objective(ObjectiveSpec(name="fields_clash", fields=("labels", "a b"), **spec))
