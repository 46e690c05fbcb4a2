"""A stop request during a long cache build (``llmft prepare``, ``llmft train``'s data preparation):
a real process group gets SIGTERM, as from a scheduler, once the first tokenized shard is on disk.
The command ends with exit 75 and one stop line (the tokenizing workers ignore the signal), keeps
its finished shards, and the rerun reuses them and writes an entry byte-identical to one built
without a stop (docs/data.md, "Resumable builds")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, write_recipe

# Tokenizing is slowed to ~0.8 s a shard (16 batches of 256 records), in this wrapper only, so that
# the signal, sent when the first shard appears, finds the others unfinished.
SLOW = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from llmft.data import rows
real = rows.Tokenize.__call__
def slow(self, batch):
    time.sleep(0.05)
    return real(self, batch)
rows.Tokenize.__call__ = slow
from llmft.cli import main
sys.exit(main(sys.argv[1:]))
"""
RECORDS = 40_000  # 10 shards of 4096


def _setup(root: Path) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "train.jsonl", "w") as f:
        for i in range(RECORDS):
            f.write(f'{{"text": "{"abcdefgh"[i % 8] * (i % 40 + 1)}"}}\n')
    recipe = write_recipe(root, data__cache_dir=str(root / "cache"), data__num_proc=2, data__packing=True)
    (root / "slow.py").write_text(SLOW)
    return recipe, root / "cache"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _stopped(root: Path, command: str) -> tuple[Path, Path, str]:
    recipe, cache = _setup(root)
    proc = subprocess.Popen(
        [sys.executable, str(root / "slow.py"), command, str(recipe)],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not list(cache.glob("*.build/shards/*.arrow")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group: the builder and its workers
        _, err = proc.communicate(timeout=30)  # a stop ends the build within a poll, not the whole build
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, err[-3000:]
    assert [line for line in err.splitlines() if "SIGTERM" in line] == [
        "[llmft] SIGTERM received: stopping the data build; its finished shards are kept, "
        "and the same command continues from them"
    ], err[-3000:]
    assert "Traceback" not in err
    (work,) = cache.glob("*.build")
    assert sorted(p.name for p in work.iterdir()) == ["shards"]  # no half-written entry, no worker leftovers
    done = sorted(p.name for p in (work / "shards").iterdir())
    assert 1 <= len(done) < 10 and all(p.endswith(".arrow") for p in done), done
    return recipe, cache, f"reusing {len(done)} of 10 tokenized shards of a stopped build"


def _entry_files(cache: Path) -> dict[str, bytes]:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.endswith(".build")]
    return {p.name: p.read_bytes() for p in entry.iterdir() if p.name != "meta.json"}


def test_sigterm_during_prepare_exits_75_and_the_rerun_reuses_the_finished_shards(tmp_path):
    recipe, cache, reuse = _stopped(tmp_path / "stopped", "prepare")
    again = subprocess.run(
        [sys.executable, "-m", "llmft", "prepare", str(recipe)],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert reuse in again.stderr
    assert not list(cache.glob("*.build"))
    ref_recipe, ref_cache = _setup(tmp_path / "ref")
    ref = subprocess.run(
        [sys.executable, "-m", "llmft", "prepare", str(ref_recipe)],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert _entry_files(cache) == _entry_files(ref_cache)  # byte for byte: rows, layout, prompts


@pytest.mark.slow
def test_sigterm_during_trains_data_preparation_exits_75_with_one_line(tmp_path):
    _stopped(tmp_path, "train")
