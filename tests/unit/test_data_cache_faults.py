"""Faults of the token cache: damaged entries are rebuilt (never trained on), a cache dir that cannot
be written is a message naming it, a stop during a build keeps the finished shards for the next one.
(The hypothesis harness over damaged entries: test_data_cache_fuzz.py; a real SIGTERM to
``llmft prepare``: tests/integration/test_data_prepare_stop.py.)"""

import errno
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from llmft.data import build_data
from llmft.data import cache as cache_module
from llmft.data import shards as shards_module
from llmft.data.cache import BUILD_SUFFIX, CHECKSUM_BLOCK, Damaged, check_entry
from llmft.data.tokenizer import byte_tokenizer
from llmft.data.tokens import TokenDataset
from llmft.errors import UserError
from llmft.recipe.schema import Recipe
from llmft.stop import STOPPED_EXIT_CODE, Stopped, StopRequest


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def recipe(tmp_path, train, **data) -> Recipe:
    r = Recipe()
    r.data.train = str(train)
    r.data.cache_dir = str(tmp_path / "cache")
    r.data.max_seq_len = data.pop("max_seq_len", 64)
    for k, v in data.items():
        setattr(r.data, k, v)
    return r


def arrays(ds: TokenDataset) -> tuple:
    return ds._input_ids.tolist(), ds._target.tolist(), ds._offsets.tolist()


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": "a" * (i % 7 + 1)} for i in range(40)])


def test_one_flipped_bit_in_the_token_file_rebuilds_the_entry(tmp_path, data, caplog):
    first = build_data(recipe(tmp_path, data), byte_tokenizer())
    want, path = arrays(first.train), first.train.path
    del first
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2
    raw[at] ^= 0x01  # one bit; the size stays the same
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="llmft"):
        again = build_data(recipe(tmp_path, data), byte_tokenizer())
    assert again.entries[0]["built"] and arrays(again.train) == want
    assert f"data cache: {path}: does not match the checksum written when the entry was built" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "garbage", "a list", "edited"])
def test_a_damaged_meta_json_rebuilds_the_entry(tmp_path, data, damage, caplog):
    first = build_data(recipe(tmp_path, data), byte_tokenizer())
    want, meta = arrays(first.train), first.train.path.parent / "meta.json"
    text = meta.read_text()
    meta.write_text(
        {
            "truncated": text[: len(text) // 2],
            "garbage": "\x00\xff not json",
            "a list": "[1, 2]",
            "edited": text.replace('"records": 40', '"records": 41'),
        }[damage]
    )
    with caplog.at_level(logging.WARNING, logger="llmft"):
        again = build_data(recipe(tmp_path, data), byte_tokenizer())
    assert again.entries[0]["built"] and arrays(again.train) == want and again.stats == first.stats
    assert f"data cache: {meta}: " in caplog.text


def test_verify_reads_blocks_and_names_the_file(tmp_path, data):
    entry = build_data(recipe(tmp_path, data), byte_tokenizer()).train.path.parent
    meta = check_entry(entry)
    assert set(meta["files"]) == {
        "rows.arrow",
        "rows.layout.json",
        "prompts.arrow",
        "prompts.layout.json",
        "prompts.json",
    }
    assert all(len(f["crc32"]) == -(-f["bytes"] // CHECKSUM_BLOCK) for f in meta["files"].values())
    (entry / "prompts.json").unlink()
    with pytest.raises(Damaged, match=f"{entry / 'prompts.json'}: cannot be read"):
        check_entry(entry)


def test_a_cache_dir_that_cannot_be_written_is_a_message(tmp_path, data, monkeypatch):
    # root cannot be refused by file modes here; the lock file's open is where a read-only dir fails
    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(cache_module, "open", refused, raising=False)
    with pytest.raises(UserError) as e:
        build_data(recipe(tmp_path, data), byte_tokenizer())
    root = tmp_path / "cache"
    assert str(e.value).startswith(f"data.cache_dir: cannot write '{root}/")
    assert f"(Permission denied). Set data.cache_dir=<a folder you can write> (now '{root}')" in str(e.value)
    assert e.value.exit_code == 2


def test_a_full_disk_during_the_build_is_a_message_and_leaves_nothing(tmp_path, data, monkeypatch):
    def full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(TokenDataset, "write", full)
    with pytest.raises(UserError) as e:
        build_data(recipe(tmp_path, data), byte_tokenizer())
    root = tmp_path / "cache"
    text = str(e.value)
    assert (
        text.startswith(f"data.cache_dir: cannot write '{root}/") and "rows.arrow' (No space left on device); " in text
    )
    assert "GiB free there. Free space there, or set data.cache_dir=<a folder with room>" in text
    assert sorted(p.suffix for p in root.iterdir()) == [".lock"]  # no half-built folder left


def test_a_full_disk_in_a_tokenizing_worker_is_the_same_message(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "x" * (i % 50 + 1)} for i in range(9000)])  # 3 shards

    def full(chunk, tokenize, job, path, check):  # runs in the forked worker
        raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".part")

    monkeypatch.setattr(shards_module, "_write_shard", full)
    with pytest.raises(UserError) as e:
        build_data(recipe(tmp_path, path, num_proc=2), byte_tokenizer())
    root = tmp_path / "cache"
    assert str(e.value).startswith(f"data.cache_dir: cannot write '{root}/")
    assert ".arrow.part' (No space left on device); " in str(e.value)
    assert sorted(p.suffix for p in root.iterdir()) == [".lock"]


def test_a_source_file_that_cannot_be_read_is_named(tmp_path, data, monkeypatch):
    from pathlib import Path as RealPath

    real = RealPath.read_bytes

    def read_bytes(self):
        if self == data:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(RealPath, "read_bytes", read_bytes)
    with pytest.raises(UserError) as e:
        build_data(recipe(tmp_path, data), byte_tokenizer())
    assert (
        str(e.value)
        == f"{data}: cannot be read (Permission denied). Check that it exists and that this user can read it."
    )
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".lock"]


def _stop_after_first_shard(monkeypatch):
    """SIGTERM to this process once the first shard is written, as a scheduler would send it."""
    real = shards_module._write_shard

    def write(*args):
        real(*args)
        if not getattr(write, "sent", False):
            write.sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(shards_module, "_write_shard", write)


def test_a_stop_keeps_finished_shards_and_the_next_build_reuses_them(tmp_path, monkeypatch, caplog):
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "x" * (i % 50 + 1)} for i in range(9000)])  # 3 shards
    whole = build_data(recipe(tmp_path / "whole", path, num_proc=1), byte_tokenizer())
    _stop_after_first_shard(monkeypatch)
    stop = StopRequest().install()
    try:
        with caplog.at_level(logging.INFO, logger="llmft"), pytest.raises(Stopped) as e:
            build_data(recipe(tmp_path, path, num_proc=1), byte_tokenizer())
    finally:
        stop.uninstall()
    assert e.value.exit_code == STOPPED_EXIT_CODE
    stops = [r.getMessage() for r in caplog.records if "SIGTERM" in r.getMessage()]
    assert stops == ["SIGTERM received: stopping the data build; its finished shards are kept, and the same command continues from them"]  # fmt: skip
    (work,) = (tmp_path / "cache").glob(f"*{BUILD_SUFFIX}")
    assert sorted(p.name for p in work.iterdir()) == ["shards"]  # the half-built entry is gone
    assert [p.name for p in (work / "shards").iterdir()] == ["chunk0-0-4096.arrow"]
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmft"):
        again = build_data(recipe(tmp_path, path, num_proc=1), byte_tokenizer())
    assert "data.train: reusing 1 of 3 tokenized shards of a stopped build" in caplog.text
    assert again.entries[0]["built"] and arrays(again.train) == arrays(whole.train)
    assert not work.exists()
    entry, other = Path(again.entries[0]["entry"]), Path(whole.entries[0]["entry"])
    assert entry.name == other.name  # the same key
    for name in ("rows.arrow", "rows.layout.json", "prompts.arrow", "prompts.layout.json", "prompts.json"):
        assert (entry / name).read_bytes() == (other / name).read_bytes()


def test_a_stop_while_waiting_for_another_builder_ends_the_wait(tmp_path, data):
    import fcntl

    r = recipe(tmp_path, data)
    build_data(r, byte_tokenizer())  # learn the key
    root = tmp_path / "cache"
    (entry,) = [p for p in root.iterdir() if p.is_dir()]
    cache_module._remove(entry)
    stop = StopRequest().install()
    with open(root / f"{entry.name}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another builder holds it (flock locks are per open file)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(Stopped):
                build_data(r, byte_tokenizer())
        finally:
            stop.uninstall()
    assert not entry.exists()


def test_shard_ranges_depend_on_the_record_count_alone():
    assert shards_module.shard_ranges(9000) == [(0, 4096), (4096, 8192), (8192, 9000)]
    ranges = shards_module.shard_ranges(10_000_000)
    assert len(ranges) == 256 and ranges[-1][1] == 10_000_000
    assert np.all(np.diff([lo for lo, _ in ranges]) == ranges[0][1])


def test_a_stopped_build_no_one_resumes_is_removed_after_a_week(tmp_path, data, caplog):
    root = tmp_path / "cache"
    old, recent = root / f"{'a' * 24}{BUILD_SUFFIX}", root / f"{'b' * 24}{BUILD_SUFFIX}"
    for work in (old, recent):
        (work / "shards").mkdir(parents=True)
        (work / "shards" / "chunk0-0-4096.arrow").write_bytes(b"x")
    week_ago = time.time() - 7 * 86400 - 60
    os.utime(old, (week_ago, week_ago))
    with caplog.at_level(logging.INFO, logger="llmft"):
        build_data(recipe(tmp_path, data), byte_tokenizer())
    assert not old.exists() and recent.exists()
    assert f"data cache: removing {old}, a stopped build not resumed for 7 days" in caplog.text


def test_a_users_folder_ending_in_build_in_the_cache_dir_is_never_removed(tmp_path, data):
    """Only the cache's own stopped builds (a 24-hex-digit key) are orphans: ``website.build`` of the
    user's, a week old, survives a build byte for byte and gets no lock file beside it."""
    root = tmp_path / "cache"
    mine = root / f"website{BUILD_SUFFIX}"
    mine.mkdir(parents=True)
    (mine / "index.html").write_text("mine")
    week_ago = time.time() - 7 * 86400 - 60
    os.utime(mine, (week_ago, week_ago))
    build_data(recipe(tmp_path, data), byte_tokenizer())
    assert (mine / "index.html").read_text() == "mine"
    assert not (root / "website.lock").exists()


def test_a_stop_while_the_source_files_are_read_ends_the_build_before_the_next_file(tmp_path, monkeypatch):
    """A source of many files is read file by file; a stop that arrives while one is read ends the
    build before the next one is opened (exit 75, nothing tokenized)."""
    from llmft.data import read as read_module

    folder = tmp_path / "data"
    folder.mkdir()
    for k in range(3):
        write_jsonl(folder / f"part-{k}.jsonl", [{"text": f"{k} {i}"} for i in range(50)])
    seen, real = [], read_module._jsonl_table

    def table(path, i, schema):
        seen.append(path.name)
        stop.requested = "SIGTERM"  # the signal arrives while this file is read
        return real(path, i, schema)

    monkeypatch.setattr(read_module, "_jsonl_table", table)
    stop = StopRequest().install()
    try:
        with pytest.raises(Stopped):
            build_data(recipe(tmp_path, str(folder), num_proc=1), byte_tokenizer())
    finally:
        stop.uninstall()
    assert seen == ["part-0.jsonl"]
    assert not list((tmp_path / "cache").glob("*/rows.arrow"))
