"""The tokenized-data cache: reused when everything that shapes it matches, never otherwise; llmft prepare;
sources (globs, CSV, fields, hub ids offline) and weighted mixtures."""

import json
import logging
import os

import numpy as np
import pytest
from helpers import data_recipe, rows, write_jsonl, write_recipe

import llmft
from llmft.cli import main
from llmft.data import MicroBatchSampler, build_data
from llmft.data.mixture import MixedDataset
from llmft.data.sampler import GlobalOrder
from llmft.data.tokenizer import byte_tokenizer
from llmft.data.tokens import TokenDataset
from llmft.errors import UserError
from llmft.plan.batch import BatchPlan


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": "a" * (i % 7 + 1)} for i in range(40)])


def test_second_build_reuses_the_entry_and_is_memory_mapped(tmp_path, data):
    first = build_data(data_recipe(tmp_path, str(data)), byte_tokenizer())
    second = build_data(data_recipe(tmp_path, str(data)), byte_tokenizer())
    assert [e["built"] for e in first.entries] == [True] and [e["built"] for e in second.entries] == [False]
    assert rows(first.train) == rows(second.train) and first.stats == second.stats
    assert not second.train._input_ids.flags.owndata  # a view of the memory map, not a copy
    assert sorted(os.listdir(tmp_path / "cache")) == [
        os.path.basename(first.entries[0]["entry"]) + s for s in ("", ".lock")
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"max_seq_len": 32},
        {"packing": True},
        {"train_on": "all"},
        {"chat_template": "chatml"},
        {"on_bad_record": "skip"},
        {"eval_fraction": 0.25},
    ],
)
def test_other_settings_never_reuse_an_entry(tmp_path, data, change, caplog):
    base = build_data(data_recipe(tmp_path, str(data)), byte_tokenizer())
    with caplog.at_level(logging.INFO, logger="llmft.data"):
        other = build_data(data_recipe(tmp_path, str(data), **change), byte_tokenizer())
    assert other.entries[0]["built"] and other.entries[0]["entry"] != base.entries[0]["entry"]
    why = [r.getMessage() for r in caplog.records if "holds this data with other settings" in r.getMessage()]
    assert len(why) == 1 and why[0].startswith(f"data cache: {base.entries[0]['entry']} holds this data")


def test_changed_file_tokenizer_or_llmft_version_rebuilds(tmp_path, data, monkeypatch):
    r = data_recipe(tmp_path, str(data))
    first = build_data(r, byte_tokenizer()).entries[0]["entry"]
    with open(data, "a") as f:
        f.write(json.dumps({"prompt": "new", "completion": "record"}) + "\n")
    grown = build_data(r, byte_tokenizer())
    assert grown.entries[0]["built"] and grown.stats["records"] == 41 and grown.entries[0]["entry"] != first
    tok = byte_tokenizer()
    tok.add_tokens(["qq"])  # other token ids for the same text
    assert build_data(r, tok).entries[0]["built"]
    monkeypatch.setattr(llmft, "__version__", "999.0")
    assert build_data(r, byte_tokenizer()).entries[0]["built"]


def test_a_crashed_build_leaves_no_entry_and_the_next_one_builds(tmp_path, data, monkeypatch):
    import llmft.data.kinds.sequences as entry

    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(entry, "build_rows", boom)
    with pytest.raises(RuntimeError):
        build_data(data_recipe(tmp_path, str(data)), byte_tokenizer())
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".lock"]
    monkeypatch.undo()
    assert build_data(data_recipe(tmp_path, str(data)), byte_tokenizer()).entries[0]["built"]


def test_num_proc_gives_the_same_rows(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "x" * (i % 50 + 1)} for i in range(9000)])
    one = build_data(data_recipe(tmp_path, str(path), num_proc=1, packing=True), byte_tokenizer())
    two = build_data(data_recipe(tmp_path / "other", str(path), num_proc=2, packing=True), byte_tokenizer())
    assert two.entries[0]["built"] and one.stats == two.stats
    assert np.array_equal(one.train._input_ids, two.train._input_ids)
    assert np.array_equal(one.train._target, two.train._target)
    # the lines the workers mapped were written into the build dir, and removed with it
    entry = two.entries[0]["entry"]
    assert sorted(os.listdir(entry)) == [
        "meta.json",
        "prompts.arrow",
        "prompts.json",
        "prompts.layout.json",
        "rows.arrow",
        "rows.layout.json",
    ]


def test_token_dataset_round_trips_through_arrow(tmp_path):
    rows_in = [([1, 2, 3], [-100, 2, 3], None), ([4], [4], None)]
    ds = TokenDataset(rows_in)
    ds.write(tmp_path / "r.arrow")
    back = TokenDataset.open(tmp_path / "r.arrow")
    assert (
        rows(back)
        == rows(ds)
        == [
            {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": None},
            {"input_ids": [4], "labels": [4], "position_ids": None},
        ]
    )
    import pickle

    assert rows(pickle.loads(pickle.dumps(back))) == rows(ds)  # workers re-open the map


def test_a_cache_file_changed_after_its_layout_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "de"}])
    file = build_data(data_recipe(tmp_path, str(path)), byte_tokenizer()).train.path
    with open(file, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(UserError) as e:
        TokenDataset.open(file)
    assert str(e.value).count("the cache entry was changed") == 1 and f"Delete the entry {file.parent}" in str(e.value)


# --- llmft prepare ----------------------------------------------------------------------


def test_prepare_fills_the_cache_that_train_then_uses(tmp_path, capsys):
    path = write_recipe(tmp_path, data__cache_dir=str(tmp_path / "cache"), data__packing=True)
    assert main(["prepare", str(path)]) == 0
    out = capsys.readouterr().out
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    assert f"data.train: {tmp_path / 'train.jsonl'}\n  entry {entry} (built, " in out
    assert "64 records -> 64 examples" in out and "packing efficiency" in out
    assert main(["prepare", str(path)]) == 0
    assert f"entry {entry} (already there" in capsys.readouterr().out
    from llmft.recipe import load_recipe

    again = build_data(load_recipe(str(path), []), byte_tokenizer())
    assert again.entries[0] == {**again.entries[0], "entry": str(entry), "built": False}


# --- sources ------------------------------------------------------------------------------


def test_glob_csv_and_fields(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"question": "q1", "answer": "a1"}])
    (tmp_path / "d" / "b.csv").write_text("question,answer\nq2,a2\n")
    src = {"path": str(tmp_path / "d" / "*"), "fields": {"prompt": "question", "completion": "answer"}}
    tok = byte_tokenizer()
    bundle = build_data(data_recipe(tmp_path, [src]), tok)
    assert [tok.decode(r["input_ids"]) for r in rows(bundle.train)] == ["<bos>q1a1<eos>", "<bos>q2a2<eos>"]


@pytest.mark.parametrize(
    "src, message",
    [
        (
            {"path": "x.jsonl", "wieght": 2},
            "data.train[0].wieght: is not a source setting. Did you mean 'weight'? A source takes path, weight, "
            "split, name, revision, train_on, fields.",
        ),
        (
            {"path": "x.jsonl", "weight": 0},
            "data.train[0].weight: must be a number > 0, got 0. Use e.g. 2 (twice per epoch) or 0.5.",
        ),
        (
            {"path": "x.jsonl", "fields": {"promt": "q"}},
            "data.train[0].fields.promt: is not a record field. Did you mean 'prompt'? Map one of text, prompt, "
            "completion, messages, chosen, rejected to the column that holds it.",
        ),
    ],
)
def test_bad_source_settings(tmp_path, src, message):
    with pytest.raises(UserError) as e:
        build_data(data_recipe(tmp_path, [src]), byte_tokenizer())
    assert str(e.value) == message


def test_hub_id_offline_says_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        build_data(data_recipe(tmp_path, {"path": "nobody/nothing", "split": "train"}), byte_tokenizer())
    text = str(e.value)
    assert text.startswith(
        "data.train: 'nobody/nothing' is not a local path, and no hub dataset of that name could be loaded (offline"
    )
    assert "(ConnectionError: Couldn't reach 'nobody/nothing' on the Hub (OfflineModeIsEnabled))" in text
    assert text.endswith(
        "'nobody/nothing' is not in the local Hugging Face cache (HF_HOME) and downloads are off (HF_HUB_OFFLINE=1): "
        "download it once on a machine with network access (`hf download nobody/nothing --repo-type dataset`) "
        "into the HF_HOME this job uses, or point at a local directory (docs/offline.md)."
    )


# --- mixtures -------------------------------------------------------------------------------


def test_weights_repeat_and_subsample_each_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(10)])
    tok = byte_tokenizer()
    bundle = build_data(data_recipe(tmp_path, [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}]), tok)
    assert isinstance(bundle.train, MixedDataset) and len(bundle.train) == 25 == bundle.stats["mixture_rows"]
    texts = [tok.decode(r["input_ids"])[5:-5] for r in rows(bundle.train)]
    assert sorted(texts[:20]) == sorted([f"a{i}" for i in range(10)] * 2)
    assert len(set(texts[20:])) == 5 and all(t.startswith("b") for t in texts[20:])
    again = build_data(data_recipe(tmp_path, [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}]), tok)
    assert rows(again.train) == rows(bundle.train)  # the subset is a function of the seed


def test_mixture_order_resumes_on_any_layout(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(7)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(5)])
    ds = build_data(data_recipe(tmp_path, [str(a), {"path": str(b), "weight": 1.6}]), byte_tokenizer()).train
    order = GlobalOrder(len(ds), 3, True)

    def taken(micro, acc, dp, start, steps):
        out = []
        for step in range(steps):
            for rank in range(dp):
                plan = BatchPlan(6, micro, acc, dp)
                s = MicroBatchSampler(order, plan, rank, start_position=start + 6 * step, num_steps=1)
                out += [i for mb in s for i in mb]
        return out

    straight = taken(6, 1, 1, 0, 6)
    assert straight == taken(3, 1, 2, 0, 3) + taken(1, 3, 2, 18, 3)  # resumed on another layout
    assert sorted(straight[:15]) == list(range(15))  # an epoch of the mixture is a permutation


def test_jsonl_lines_split_by_arrow_are_the_per_line_readers_records(tmp_path):
    """The vectorised JSONL split keeps every line number, skips the same blank lines, and leaves a
    file with a non-UTF-8 line to the per-line reader, which names the line."""
    from llmft.data.read import _jsonl_rows, _read_lines

    cases = [
        b'{"text": "ok"}\n\n{"text": "x",}\n   \n\xc2\xa0\n{"text": "\xc3\xa9"}',  # no newline at the end
        b'{"text": "ok"}\r\n{"text": "y"}\n',
        b'{"text": "ok"}\n\xff\xfe\n{"text": "z"}\n',
        b"",
        b"\n\n",
    ]
    files = []
    for k, data in enumerate(cases):
        files.append(tmp_path / f"f{k}.jsonl")
        files[-1].write_bytes(data)
    want = [
        {"file": i, "pos": pos, "json": text, "error": error}
        for i, path in enumerate(files)
        for pos, text, error in _jsonl_rows(path)
    ]
    assert _read_lines(files, tmp_path / "work", 0).dataset.to_list() == want
    assert [r["pos"] for r in want if r["file"] == 0] == [1, 3, 6]
    assert want[-2] == {"file": 2, "pos": 2, "json": None, "error": "not valid UTF-8 (invalid start byte at byte 0)"}


def test_kept_tokens_equal_the_indexed_ranges_for_every_selection():
    """build_rows takes the kept tokens as the arrays themselves where all records are whole and in order,
    else gathered a block at a time; every selection gives exactly ``ids[ranges(starts, kept)]``."""
    from llmft.data.pack import ranges
    from llmft.data.rows import kept_tokens

    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 30))
        lens = rng.integers(0, 9, n)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ids = rng.integers(0, 1000, offsets[-1]).astype(np.int32)
        target = rng.integers(0, 2, offsets[-1]).astype(np.uint8)
        items = np.arange(n)
        if trial % 3 == 0:  # records dropped (no target within max_seq_len)
            items = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False))
        if trial % 5 == 0:  # a held-out split's shuffled order
            items = rng.permutation(n)
        starts = offsets[items]
        kept = lens[items] if trial % 2 else np.minimum(lens[items], rng.integers(0, 9))  # truncated
        got_ids, got_target = kept_tokens(ids, target, offsets, starts, kept)
        take = ranges(starts, kept)
        assert np.array_equal(got_ids, ids[take]) and np.array_equal(got_target, target[take]), trial


def test_prefix_counts_equal_the_running_count_across_blocks():
    """build_rows counts each record's targets from prefix sums taken a block of tokens at a time."""
    from llmft.data.rows import prefix_counts

    rng = np.random.default_rng(1)
    for trial in range(200):
        mask = rng.integers(0, 2, int(rng.integers(0, 60))).astype(np.uint8)
        at = rng.integers(0, len(mask) + 1, int(rng.integers(0, 40)))
        expected = np.concatenate([[0], np.cumsum(mask)])[at]
        for block in (1, 3, 7, 1 << 24):
            assert np.array_equal(prefix_counts(mask, at, block=block), expected), (trial, block)


def test_take_ranges_gathers_a_block_at_a_time_as_one_index():
    from llmft.data.arrays import ranges, take_ranges

    rng = np.random.default_rng(2)
    for trial in range(100):
        a = rng.integers(0, 1000, 80).astype(np.int32)
        b = rng.integers(0, 2, 80).astype(np.uint8)
        n = int(rng.integers(0, 12))
        lengths = rng.integers(0, 9, n)
        starts = rng.integers(0, 80 - 8, n)  # any order, overlaps allowed
        take = ranges(starts, lengths)
        for block in (1, 5, 1 << 22):
            got_a, got_b = take_ranges((a, b), starts, lengths, block_tokens=block)
            assert np.array_equal(got_a, a[take]) and np.array_equal(got_b, b[take]), (trial, block)
            assert got_a.dtype == np.int32 and got_b.dtype == np.uint8
