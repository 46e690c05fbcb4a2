"""Whole training runs under torchrun on gloo, against one process (docs/design.md G1).

test_engines.py proves one SGD step per engine; these run longer and in the ways a
user launches: many AdamW steps with clipping, adapters on sharded engines, two
"nodes", and a compiled plan launched on another world size.

Default suite (one launch): a recipe compiled for 4 processes and launched on 2.
Slow (``pytest -m slow``): everything else, one torchrun launch per run.

Tolerances are absolute, on the logged loss (the token-mean loss of the global batch,
3.5-5.8 here): 1e-5 for a few steps, 1e-3 for 20 AdamW steps. Turning clipping off
moves the 20-step curve by ~5e-2, so 1e-3 still sees a lost or doubled clip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, free_port, metrics, torchrun, train_inproc, write_recipe

pytestmark = pytest.mark.distributed

LOSS_TOL = 1e-3  # absolute, 20 AdamW steps
NORM_RTOL = 1e-3  # relative, pre-clip global gradient norm
SHORT_TOL = 1e-5  # absolute, a few steps
LAUNCH_TIMEOUT = 900  # the test machines have 2 shared cores


def _single(recipe: Path, out: Path, *overrides: str) -> list[dict]:
    """The reference: one process, the whole global batch in one micro-batch."""
    code = train_inproc(
        recipe, *overrides, "distributed.engine=single", "batch.micro_batch_size=8", f"run.output_dir={out}"
    )
    assert code == 0
    return metrics(out)


def _losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _check_launch(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-6000:]}"


# --- default: compiled for 4 processes, launched on 2 ----------------------------------------


def test_compiled_for_4_launched_on_2_resolves_accumulation(tmp_path):
    """`llmft compile --nproc-per-node 4` then `torchrun --nproc_per_node 2 -m llmft train DIR`:
    the global batch stays 8, accumulation is re-solved 2 -> 4, and DeepSpeed (which checks
    train_batch_size = micro x accumulation x world itself) trains the same losses as one process."""
    recipe = write_recipe(tmp_path, train__max_steps=3)
    compiled = tmp_path / "compiled"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmft",
            "compile",
            str(recipe),
            "distributed.engine=deepspeed",
            "distributed.zero_stage=2",
            "batch.micro_batch_size=1",
            "--nproc-per-node",
            "4",
            "--out",
            str(compiled),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "micro 1 x accumulation 2 x data-parallel 4 = global 8" in done.stdout + done.stderr

    done = torchrun(["train", str(compiled)], nproc=2, timeout=LAUNCH_TIMEOUT)
    _check_launch(done)
    assert "re-solved to micro 1 x accumulation 4 x data-parallel 2 = global 8" in done.stderr

    run_dir = tmp_path / "run"
    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    b, d = resolved["batch"], resolved["distributed"]
    assert d["nnodes"] * d["nproc_per_node"] == 2
    assert (b["global_batch_size"], b["micro_batch_size"], b["gradient_accumulation_steps"]) == (8, 1, 4)
    assert b["micro_batch_size"] * b["gradient_accumulation_steps"] * 2 == b["global_batch_size"]
    state = json.loads((run_dir / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["batch"]["gradient_accumulation_steps"] == 4

    rows = metrics(run_dir)
    ref = _single(recipe, tmp_path / "single")
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]
    assert _max_abs_diff(_losses(rows), _losses(ref)) < SHORT_TOL


# --- slow: 20 AdamW steps on every engine ------------------------------------------------------

ADAMW_20 = ["optim.name=adamw", "optim.lr=1e-3", "optim.scheduler=constant", "optim.max_grad_norm=1.0"]
STEPS_20 = "train.max_steps=20"

ENGINES = {  # global 8 on 2 ranks
    "ddp": ["distributed.engine=ddp", "batch.micro_batch_size=2"],  # 2 x 2 x 2
    "fsdp": ["distributed.engine=fsdp", "batch.micro_batch_size=2"],  # 2 x 2 x 2
    "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2", "batch.micro_batch_size=2"],  # 2 x 2 x 2
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=1"],  # 1 x 4 x 2
}


@pytest.fixture(scope="module")
def adamw_single(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("adamw_single")
    rows = _single(write_recipe(tmp), tmp / "run", *ADAMW_20, STEPS_20)
    assert max(r["grad_norm"] for r in rows) > 1.0  # clipping at 1.0 really acts
    return rows


@pytest.fixture(scope="module")
def adamw_engine(tmp_path_factory):
    """One launch per engine, shared by the per-engine test and the cross-engine test."""
    cache: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def run(name: str) -> list[dict]:
        if name not in cache:
            tmp = tmp_path_factory.mktemp(f"adamw_{name}")
            done = torchrun(
                ["train", str(write_recipe(tmp)), *ADAMW_20, STEPS_20, *ENGINES[name]], timeout=LAUNCH_TIMEOUT
            )
            cache[name] = (done, tmp / "run")
        done, run_dir = cache[name]
        _check_launch(done)
        return metrics(run_dir)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_adamw_20_steps_match_single_process(adamw_single, adamw_engine, engine):
    rows = adamw_engine(engine)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in adamw_single]
    assert _max_abs_diff(_losses(rows), _losses(adamw_single)) < LOSS_TOL
    # The norm that clipping divides by is the global one, on every engine.
    for r, ref in zip(rows, adamw_single, strict=True):
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= NORM_RTOL * ref["grad_norm"], (r["step"], engine)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_adamw_20_steps_deepspeed_matches_fsdp(adamw_engine, zero):
    assert _max_abs_diff(_losses(adamw_engine(zero)), _losses(adamw_engine("fsdp"))) < LOSS_TOL


@pytest.mark.slow
def test_clipping_is_visible_at_this_tolerance(tmp_path, adamw_single):
    """Guards the tolerance above: an engine that skipped clipping would fail those tests."""
    unclipped = _single(write_recipe(tmp_path), tmp_path / "run", *ADAMW_20, STEPS_20, "optim.max_grad_norm=null")
    assert _max_abs_diff(_losses(unclipped), _losses(adamw_single)) > 10 * LOSS_TOL


# --- slow: adapters on sharded engines ---------------------------------------------------------

ADAPTER_10 = ["peft.method=lora", "optim.lr=3e-3", "optim.max_grad_norm=1.0", "train.max_steps=10"]


def _learnable_recipe(tmp: Path, **sections) -> Path:
    """One record repeated: a tiny model learns it within 10 steps."""
    tmp.mkdir(parents=True, exist_ok=True)
    with open(tmp / "train.jsonl", "w") as f:
        for _ in range(16):
            f.write(json.dumps({"prompt": "reverse abcdefgh:", "completion": "hgfedcba"}) + "\n")
    return write_recipe(tmp, **sections)


def _assert_learns(rows: list[dict]) -> None:
    losses = _losses(rows)
    assert len(losses) == 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.2, losses


ADAPTER_CASES = {
    # QLoRA: NF4 base packed in the fp32 compute dtype (quant_storage_for) so FSDP2 can shard it.
    "qlora_fsdp": ({"model__quantization": {"bits": 4}}, ["distributed.engine=fsdp", "batch.micro_batch_size=2"]),
    # ... and ZeRO-3 partitions it the same way (each rank keeps half of every packed weight).
    "qlora_zero3": (
        {"model__quantization": {"bits": 4}},
        ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=2"],
    ),
    "lora_zero3": (
        {},
        ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=1"],
    ),
}


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    """One launch per adapter case, shared by the per-case test and the cross-engine test."""
    cache: dict[str, Path] = {}

    def run(case: str) -> tuple[Path, Path]:
        if case not in cache:
            sections, overrides = ADAPTER_CASES[case]
            tmp = tmp_path_factory.mktemp(f"adapter_{case}")
            recipe = _learnable_recipe(tmp, **sections)
            _check_launch(torchrun(["train", str(recipe), *ADAPTER_10, *overrides], timeout=LAUNCH_TIMEOUT))
            cache[case] = recipe
        recipe = cache[case]
        return recipe, recipe.parent / "run"

    return run


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_adapter_on_sharded_engine_learns(tmp_path, adapter_run, case):
    recipe, run_dir = adapter_run(case)
    rows = metrics(run_dir)
    _assert_learns(rows)
    ref = _single(recipe, tmp_path / "single", *ADAPTER_10)
    assert _max_abs_diff(_losses(rows), _losses(ref)) < LOSS_TOL


@pytest.mark.slow
def test_qlora_zero3_matches_qlora_fsdp(adapter_run):
    """The same QLoRA recipe (same NF4 base, stored in the compute dtype; same seeded adapters) has
    the same 10-step AdamW loss curve under ZeRO-3 as under FSDP2: both shard the packed weights
    and gather them whole for each layer, so only the order of float sums differs (seen: < 1e-6)."""
    zero3, fsdp = metrics(adapter_run("qlora_zero3")[1]), metrics(adapter_run("qlora_fsdp")[1])
    assert [r["tokens"] for r in zero3] == [r["tokens"] for r in fsdp]
    assert _max_abs_diff(_losses(zero3), _losses(fsdp)) < SHORT_TOL
    for a, b in zip(zero3, fsdp, strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= NORM_RTOL * b["grad_norm"], a["step"]


# --- slow: CPU offload against the same engine without it -------------------------------------

OFFLOAD = {  # engine settings, what is offloaded
    "fsdp": (["distributed.engine=fsdp"], ["distributed.offload_params=cpu"]),
    "zero2": (
        ["distributed.engine=deepspeed", "distributed.zero_stage=2"],
        ["distributed.offload_optimizer=cpu"],
    ),
    "zero3": (
        ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
        ["distributed.offload_optimizer=cpu", "distributed.offload_params=cpu"],
    ),
}


@pytest.mark.slow
# ``-m extended``: ZeRO-2 (CI offloads on ZeRO-3, whose optimizer offload is the same DeepSpeed path).
@pytest.mark.parametrize(
    "engine", [pytest.param(e, marks=pytest.mark.extended) if e == "zero2" else e for e in OFFLOAD]
)
def test_cpu_offload_trains_like_the_same_engine_without_it(tmp_path, engine):
    """FSDP2 CPUOffloadPolicy; DeepSpeed optimizer offload (with the run's own torch AdamW:
    zero_force_ds_cpu_optimizer is off, so no DeepSpeedCPUAdam op has to be built) and ZeRO-3
    parameter offload: 4 AdamW steps with clipping give the same losses and gradient norms."""
    settings, offload = OFFLOAD[engine]
    recipe = write_recipe(tmp_path)
    common = ["train", str(recipe), *ADAMW_20, "train.max_steps=4", "batch.micro_batch_size=2", *settings]
    plain = torchrun([*common, f"run.output_dir={tmp_path / 'plain'}"], timeout=LAUNCH_TIMEOUT)
    _check_launch(plain)
    offloaded = torchrun([*common, *offload, f"run.output_dir={tmp_path / 'offloaded'}"], timeout=LAUNCH_TIMEOUT)
    _check_launch(offloaded)
    ref, rows = metrics(tmp_path / "plain"), metrics(tmp_path / "offloaded")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]
    assert _max_abs_diff(_losses(rows), _losses(ref)) < SHORT_TOL
    for r, want in zip(rows, ref, strict=True):
        assert abs(r["grad_norm"] - want["grad_norm"]) <= NORM_RTOL * want["grad_norm"], r["step"]


# --- slow: two "nodes" on one machine ----------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_c10d_rendezvous(tmp_path):
    """Two launchers (the compiled launch/torchrun.sh, c10d rendezvous), one process each."""
    recipe = write_recipe(tmp_path, train__max_steps=3)
    compiled = tmp_path / "compiled"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmft",
            "compile",
            str(recipe),
            "distributed.engine=fsdp",
            "batch.micro_batch_size=2",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--out",
            str(compiled),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # the venv's torchrun
        "OMP_NUM_THREADS": "1",
        "NNODES": "2",
        "NPROC_PER_NODE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RDZV_ID": uuid.uuid4().hex[:8],
    }
    nodes = [
        subprocess.Popen(
            ["bash", str(compiled / "launch" / "torchrun.sh")],
            env={**env, "NODE_RANK": str(n)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outputs = []
    try:
        for p in nodes:
            out, _ = p.communicate(timeout=LAUNCH_TIMEOUT)
            outputs.append(out)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for n, (p, out) in enumerate(zip(nodes, outputs, strict=True)):
        assert p.returncode == 0, f"node {n} exit {p.returncode}\n{out[-6000:]}"

    run_dir = tmp_path / "run"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in lines if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # written once, by rank 0 only
    assert sum("[llmft rank 0] done." in out for out in outputs) == 1
    ref = _single(recipe, tmp_path / "single")
    assert [r["tokens"] for r in train_rows] == [r["tokens"] for r in ref]
    assert _max_abs_diff(_losses(train_rows), _losses(ref)) < SHORT_TOL
