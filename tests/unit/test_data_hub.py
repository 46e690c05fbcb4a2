"""A hub dataset id goes through ``datasets.load_dataset(id, name=, split=, revision=)``, the call that
downloads it on a connected machine. Here the dataset lies in the local Hugging Face datasets cache,
where a download (or an offline node's pre-fetch) leaves it, so everything but the download runs:
the cached build, splits and configs, streaming, and the cache key that follows the hub data's
fingerprint (docs/data.md, Sources)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.recipe.schema import Recipe

TRAIN = [{"text": f"train record {i} " + "x" * (i % 7)} for i in range(40)]
TEST = [{"text": f"test record {i}"} for i in range(10)]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The datasets cache of this test: ``put(repo, splits, revision)`` stores a dataset there."""
    import datasets

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)

    def put(repo: str, splits: dict[str, list[dict]], revision: str = "r1") -> None:
        from datasets.data_files import DataFilesDict
        from datasets.packaged_modules.json.json import Json

        org, name = repo.split("/")
        files = {}
        for split, records in splits.items():
            path = tmp_path / f"src-{name}-{revision}-{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            files[split] = [str(path)]
        build = tmp_path / "hf-build"
        data_files = DataFilesDict.from_local_or_remote(files, base_path="/")
        builder = Json(
            cache_dir=str(build), dataset_name=name, data_files=data_files, config_name="default", hash=revision
        )
        builder.download_and_prepare()
        # Where a download of the hub repo puts it: <cache>/<org>___<name>/<config>/<version>/<hash>/
        (made,) = glob.glob(str(build / name / "default-*" / "*" / revision))
        version = os.path.basename(os.path.dirname(made))
        target = cache / f"{org}___{name}" / "default" / version / revision
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(made, target)

    return put


def recipe(tmp_path, train, **data) -> Recipe:
    r = Recipe()
    r.data.train = train
    r.data.cache_dir = str(tmp_path / "cache")
    r.data.max_seq_len = 64
    for k, v in data.items():
        setattr(r.data, k, v)
    return r


def rows(ds, n=None) -> list:
    return [tuple(ds[i]["input_ids"]) for i in range(len(ds) if n is None else n)]


def test_a_hub_dataset_gives_the_rows_of_the_same_local_records(tmp_path, hub):
    hub("org/chat-data", {"train": TRAIN, "test": TEST})
    local = tmp_path / "train.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    tok = byte_tokenizer()
    want = rows(build_data(recipe(tmp_path, str(local)), tok).train)
    first = build_data(recipe(tmp_path, {"path": "org/chat-data", "split": "train"}), tok)
    assert first.entries[0]["built"] and rows(first.train) == want
    again = build_data(recipe(tmp_path, {"path": "org/chat-data", "split": "train"}), tok)
    assert not again.entries[0]["built"] and rows(again.train) == want  # the cache entry is reused
    test = build_data(recipe(tmp_path, {"path": "org/chat-data", "split": "test", "name": "default"}), tok)
    assert test.entries[0]["built"] and len(test.train) == len(TEST)


def test_new_hub_data_is_never_served_from_the_old_entry(tmp_path, hub):
    hub("org/data", {"train": TRAIN})
    tok = byte_tokenizer()
    old = build_data(recipe(tmp_path, {"path": "org/data", "split": "train"}), tok)
    hub("org/data", {"train": TRAIN[:20]}, revision="r2")  # a newer revision downloaded beside the old one
    new = build_data(recipe(tmp_path, {"path": "org/data", "split": "train"}), tok)
    assert new.entries[0]["built"] and len(new.train) == 20 and len(old.train) == 40


def test_a_hub_dataset_streams_the_cached_rows(tmp_path, hub):
    hub("org/data", {"train": TRAIN})
    tok = byte_tokenizer()
    source = {"path": "org/data", "split": "train"}
    cached = build_data(recipe(tmp_path, source, shuffle=False), tok).train
    streamed = recipe(tmp_path, source, shuffle=False, streaming=True, stream_block=8)
    streamed.train.max_steps = 10  # a stream has no length to count epochs in
    stream = build_data(streamed, tok).train
    assert rows(stream, len(cached)) == rows(cached)


def test_an_unknown_split_of_a_hub_dataset_says_what_was_tried(tmp_path, hub):
    hub("org/data", {"train": TRAIN})
    with pytest.raises(UserError) as e:
        build_data(recipe(tmp_path, {"path": "org/data", "split": "validation"}), byte_tokenizer())
    text = str(e.value)
    assert text.startswith(
        "data.train: 'org/data' is not a local path, and no hub dataset of that name could be loaded"
    )
    assert "validation" in text


def test_a_hub_stream_resumes_from_its_cursor(tmp_path, hub):
    hub("org/data", {"train": TRAIN})
    r = recipe(tmp_path, {"path": "org/data", "split": "train"}, shuffle=True, streaming=True, stream_block=6)
    r.train.max_steps = 10
    tok = byte_tokenizer()
    straight = build_data(r, tok).train
    want = rows(straight, 100)
    resumed = build_data(r, tok).train
    resumed.restore(json.loads(json.dumps(straight.cursor_at(57))))
    assert [tuple(resumed[p]["input_ids"]) for p in range(57, 100)] == want[57:]
