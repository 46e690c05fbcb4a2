"""`bench/gpu.sh --check` runs every case and variant on CPU (docs/speed.md)."""

from __future__ import annotations

import pytest
from helpers import metrics


@pytest.mark.slow  # seven `llmft train` processes, three of them compiling: ~4.5 min on 2 cores
def test_bench_gpu_check_runs_every_case_and_variant(tmp_path):
    import os
    import subprocess
    import sys

    from helpers import ROOT

    out = tmp_path / "bench"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--check", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "gpu.md").read_text()
    for case in ("qlora-8b", "lora-8b", "full-1b"):
        for variant in ("all on", "compile off"):
            assert f"| {case} | {variant} |" in table
        on, off = metrics(out / case / "all-on"), metrics(out / case / "compile-off")
        assert len(on) == len(off) == 2
        # bf16 on CPU, compiled against eager: the tolerance docs/benchmarks.md sets for a speed switch
        assert all(abs(a["loss"] - b["loss"]) < 1e-3 for a, b in zip(on, off, strict=True))
    # long context: one variant, rows of 2048 tokens here, the memory switches on
    assert "| long-8b | long |" in table and len(metrics(out / "long-8b" / "long")) == 2
    assert "failed" not in table
