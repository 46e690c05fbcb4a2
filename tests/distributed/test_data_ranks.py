"""Two ranks that start at once share one tokenization: one builds the cache entry, the other waits on
its lock and memory-maps the result (tests/distributed/data_cache_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ROOT, torchrun_cmd, write_data, write_recipe

pytestmark = pytest.mark.distributed


def test_only_one_rank_tokenizes(tmp_path):
    write_data(tmp_path / "train.jsonl", n=6000)  # enough records that the ranks overlap in build_data
    recipe = write_recipe(tmp_path, data__cache_dir=str(tmp_path / "cache"), data__eval_fraction=0.1)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [*torchrun_cmd(2), str(ROOT / "tests" / "distributed" / "data_cache_probe.py"), str(recipe), str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert sorted(r["built"] for r in ranks) == [[False], [True]]
    assert ranks[0]["entries"] == ranks[1]["entries"] and ranks[0]["rows"] == ranks[1]["rows"]
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name] == []
