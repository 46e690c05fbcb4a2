"""`bench/gpu.sh --check` runs every case and variant on CPU, `bench/gpu.sh --check --cases moe-qwen3`
the mixture-of-experts case, and `bench/gpu.sh --quick --check` the quick GPU proof with its peer row
(docs/benchmarks.md, docs/speed.md). On CPU the numbers measure nothing; what is checked is that
every run, the peer, the timing by phase and the profile complete, that compiled and eager runs give
the same losses (fp32), and that what a machine lacks is said plainly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import ROOT, metrics

STEPS = 2  # --check's steps per run; the all-on run adds one timed by phase and one profiled


def _bench(out, *args: str) -> str:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--check", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return (out / "gpu.md").read_text()


def _same_losses(out, case: str) -> None:
    on, off = metrics(out / case / "all-on"), metrics(out / case / "compile-off")
    assert len(on) == STEPS + 2 and len(off) == STEPS
    # fp32 on CPU, compiled against eager
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(on, off, strict=False))


@pytest.mark.slow
@pytest.mark.extended  # seven `llmft train` processes, three compiling (~7 min); CI runs --quick --check
def test_bench_gpu_check_runs_every_case_and_variant(tmp_path):
    out = tmp_path / "bench"
    table = _bench(out)
    for case in ("qlora-8b", "lora-8b", "full-1b"):
        for variant in ("all on", "compile off"):
            assert f"| {case} | {variant} |" in table
        _same_losses(out, case)
    # long context: one variant, rows of 2048 tokens here, the memory switches on
    assert "| long-8b | long |" in table and len(metrics(out / "long-8b" / "long")) == 2
    assert "| moe-qwen3 |" not in table  # --check runs it only when --cases names it
    assert "failed" not in table and "Whole bench:" in table


@pytest.mark.slow  # five processes, two of them compiling: ~5 min on 2 shared cores at a load average of 15
def test_bench_gpu_quick_check_runs_both_cases_and_the_peer(tmp_path):
    out = tmp_path / "bench"
    table = _bench(out, "--quick")
    for case in ("qlora-8b", "full-1b"):
        for variant in ("all on", "compile off"):
            assert f"| {case} | {variant} |" in table
        _same_losses(out, case)
        assert f"| {case} | " in table.split("Where the time goes")[1]
        # the raw seconds (the table rounds each to 1 ms, and a CPU step here takes ~20 ms)
        phases = json.loads((out / case / "all-on.phases.json").read_text())
        wait, forward, backward, optimizer = (
            phases[f"{p}_s"] for p in ("data_wait", "forward", "backward", "optimizer")
        )
        assert forward > 0 and backward > 0 and optimizer > 0 and wait >= 0
        # phases of one step, measured inside it
        assert wait + forward + backward + optimizer <= phases["step_s"] * 1.01
        assert f"one step of {case} (cpu)" in table  # its profiled step's top ops
    assert "| lora-8b |" not in table and "| long-8b |" not in table and "| moe-qwen3 |" not in table
    # the peer: HF Trainer + PEFT + bitsandbytes on the same model directory, rows of 128 tokens here
    assert "| qlora-8b | peer: HF Trainer + PEFT + bnb |" in table
    peer = metrics(out / "qlora-8b" / "peer")
    assert [r["step"] for r in peer] == [1, 2] and all(math.isfinite(r["loss"]) for r in peer)
    assert all(r["tokens"] == 4 * 127 for r in peer)  # micro 1 x acc 4 rows, shifted labels
    assert "- qlora-8b: llmft all on reads" in table and "the peer's tokens/s" in table
    assert "failed" not in table and "Whole bench:" in table


@pytest.mark.slow  # three `llmft train` processes, one with two steps more (~40 s on 2 shared cores)
def test_bench_gpu_check_runs_the_moe_case_when_named(tmp_path):
    """moe-qwen3: the balancing loss's three modes on a tiny qwen3_moe, LoRA on the experts."""
    out = tmp_path / "bench"
    table = _bench(out, "--cases", "moe-qwen3")
    for variant in ("global_batch", "micro_batch", "aux off"):
        assert f"| moe-qwen3 | {variant} |" in table
    exact, micro, off = (metrics(out / "moe-qwen3" / v) for v in ("global_batch", "micro_batch", "aux-off"))
    assert (len(exact), len(micro), len(off)) == (STEPS + 2, STEPS, STEPS)  # the first timed by phase
    # each run's moe section: the global batch's loss and expert load, the per-micro-batch loss, none
    assert exact[0]["aux/moe_balance"] > 0 and "moe/load_max_over_mean" in exact[0]
    assert micro[0]["aux/moe_balance"] > 0 and "moe/load_max_over_mean" not in micro[0]
    assert not [k for k in off[0] if k.startswith(("aux/", "moe/"))]
    # the same weights and rows: the same task loss at the first step (the term is not in `loss`)
    assert abs(micro[0]["loss"] - exact[0]["loss"]) < 1e-6 and abs(off[0]["loss"] - exact[0]["loss"]) < 1e-6
    # the planner (and so MFU) sees the experts in the model directory: FLOPs count the active ones
    assert "- moe-qwen3: parameters " in table and " active (experts 8, 2 per token)" in table
    assert "| moe-qwen3 | " in table.split("Where the time goes")[1]
    assert "failed" not in table and "Whole bench:" in table


def test_the_moe_case_runs_under_check_only_when_named_and_never_in_quick(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu

    assert gpu.case_names(None, quick=False, check=True) == ["qlora-8b", "lora-8b", "full-1b", "long-8b"]
    assert gpu.case_names(None, quick=False, check=False)[-1] == "moe-qwen3"  # the whole GPU bench runs it
    assert gpu.case_names(None, quick=True, check=False) == gpu.case_names(None, quick=True, check=True)
    assert "moe-qwen3" not in gpu.case_names(None, quick=True, check=False)
    assert gpu.case_names("moe-qwen3", quick=False, check=True) == ["moe-qwen3"]


def test_missing_packages_are_named_with_the_fix(monkeypatch):
    """What the GPU image lacked (bitsandbytes, omegaconf, datasets, deepspeed) is said as a package
    and an install command, not a traceback."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu
    import peer_hf

    for name in ("bitsandbytes", "omegaconf", "datasets", "deepspeed"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if absent
    core = gpu.missing_core()
    assert [m.split(" ")[0] for m in core] == ["omegaconf", "datasets", "deepspeed"]
    assert gpu.case_missing(gpu.CASES["qlora-8b"]).endswith("pip install bitsandbytes")
    assert gpu.case_missing(gpu.CASES["full-1b"]) is None
    assert [m.split(" ")[0] for m in peer_hf.missing_packages()] == ["bitsandbytes"]
    assert "pip install bitsandbytes" in peer_hf.missing_packages()[0]
