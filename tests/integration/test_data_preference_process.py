"""Preference pairs across processes: tokenizing workers, DataLoader-style pickling, `llmft prepare`."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

from helpers import as_lists

from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer
from llmft.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path, train, **data) -> Recipe:
    r = Recipe()
    r.train.objective = "dpo"
    r.data.train = str(train)
    r.data.cache_dir = str(tmp_path / "cache")
    r.data.max_seq_len = 32
    for k, v in data.items():
        setattr(r.data, k, v)
    return r


def pairs(ds) -> list:
    return [as_lists(ds[i]) for i in range(len(ds))]


def test_pairs_tokenized_by_worker_processes_equal_one_process(tmp_path):
    records = [{"prompt": f"n{i}:", "chosen": "c" * (i % 9), "rejected": "r" * (i % 5)} for i in range(8200)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    one = build_data(recipe(tmp_path / "one", path, num_proc=1), byte_tokenizer())
    two = build_data(recipe(tmp_path / "two", path, num_proc=2), byte_tokenizer())
    assert len(one.train) == 8200 and pairs(one.train) == pairs(two.train)
    # a DataLoader worker gets the pairs by re-opening the entry's memory map, not a copy of the tokens
    blob = pickle.dumps(one.train)
    assert len(blob) < 2000 and pairs(pickle.loads(blob)) == pairs(one.train)


def test_llmft_prepare_builds_the_demo_pairs(tmp_path):
    yaml = tmp_path / "r.yaml"
    yaml.write_text(
        "model: {config: {model_type: llama}}\n"
        "train: {objective: dpo, max_steps: 1}\n"
        f"data: {{train: {ROOT / 'data/preference/train.jsonl'}, eval: {ROOT / 'data/preference/eval.jsonl'}, "
        f"cache_dir: {tmp_path / 'cache'}, max_seq_len: 64}}\n"
    )
    cmd = [sys.executable, "-m", "llmft", "prepare", str(yaml)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "3,000 records -> 3,000 pairs (6,000 sequences)" in proc.stdout, proc.stdout
    assert "train: 3,000 pairs of max_seq_len 64" in proc.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "already there" in again.stdout
