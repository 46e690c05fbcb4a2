"""Multi-rank stop, resume and kill (docs/design.md, G3-G5), on the same or another world size.

A 2-rank run is stopped by SIGTERM and resumed on 2 ranks (each engine's own checkpoint
format), by a plain single process with the same global batch (accumulation re-solved from
2 to 4), or a single process is stopped and resumed on 2 ranks (4 to 2). Against the
uninterrupted 2-rank run: the same losses and weights to 1e-5, and, per optimizer step, the
same samples (recorded by every rank through ``LLMFT_SAMPLE_LOG``), so nothing is skipped or
repeated. One rank SIGKILLed in the middle of a save leaves the previous checkpoint.

FSDP2 reshards through DCP; DeepSpeed ZeRO 1-3 through their universal checkpoint,
converted on the fly. The FSDP case sends SIGTERM to ONE rank only: the loop's all-reduced
stop flag must stop both after the same step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    INSTRUMENTED,
    ROOT,
    metrics,
    pretrained_model,
    sample_log,
    save_tiny_pretrained,
    torchrun,
    torchrun_cmd,
    wait_for_step,
    write_data,
    write_recipe,
)

from llmft.engines.deepspeed import deepspeed_universal
from llmft.errors import UserError
from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = pytest.mark.distributed

STEPS = 12  # 8 steps per epoch: the resumed part crosses into the second, reshuffled epoch
NUM_SAMPLES = 64
GLOBAL_BATCH = 8
TOLERANCE = 1e-5

ENGINES = {
    "ddp": {"distributed__engine": "ddp"},
    "fsdp": {"distributed__engine": "fsdp"},
    **{f"zero{n}": {"distributed__engine": "deepspeed", "distributed__zero_stage": n} for n in range(4)},
    # the checkpoint leaves the frozen base out (exclude_frozen_parameters): another universal path
    "zero3-lora": {
        "distributed__engine": "deepspeed",
        "distributed__zero_stage": 3,
        "peft__method": "lora",
        "peft__r": 4,
        "peft__alpha": 8,
    },
    # QLoRA: the NF4 base stored in the compute dtype, partitioned by ZeRO-3 like any weight
    "zero3-qlora": {
        "distributed__engine": "deepspeed",
        "distributed__zero_stage": 3,
        "peft__method": "lora",
        "peft__r": 4,
        "peft__alpha": 8,
        "model__quantization": {"bits": 4},
    },
    # ... on a pretrained base: built on the meta device, each rank quantizing only its partition
    # (llmft.model.zero3), rebuilt that way again by the resumed run
    "zero3-qlora-pretrained": {
        "distributed__engine": "deepspeed",
        "distributed__zero_stage": 3,
        "peft__method": "lora",
        "peft__r": 4,
        "peft__alpha": 8,
        "pretrained": {"bits": 4},
    },
}


def _recipe(root: Path, engine: dict, **keys) -> Path:
    write_data(root / "train.jsonl", n=NUM_SAMPLES)
    engine = dict(engine)
    quantization = engine.pop("pretrained", None)
    if quantization is not None:  # the same tiny pretrained model (seeded) for every run of the test
        hf = save_tiny_pretrained(root / "hf", seed=3)
        engine["model"] = {**pretrained_model(hf), "quantization": quantization}
    return write_recipe(
        root,
        **{
            "batch__global_batch_size": GLOBAL_BATCH,
            "batch__micro_batch_size": 2,  # accumulation 2 on 2 ranks, 4 on 1 rank
            "train__max_steps": STEPS,
            "checkpoint__every_steps": None,  # the only mid-run checkpoint is the one the stop writes
            "optim__weight_decay": 0.1,  # decay and no-decay param groups, each to be restored as built
            **engine,
            **keys,
        },
    )


def _rank_pids(launcher_pid: int, nproc: int, timeout: float = 120) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (its children), from /proc."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                if ppid != launcher_pid:
                    continue
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(stat.parent.name)
        if len(found) == nproc:
            return found
        time.sleep(0.1)
    raise AssertionError("torchrun's workers did not show up")


def _one_process(recipe: Path, sample_log: Path) -> tuple[list[str], dict]:
    """``llmft train`` as a plain process: its command line and environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMFT_SAMPLE_LOG": str(sample_log)}
    return [sys.executable, INSTRUMENTED, "train", str(recipe)], env


def _launch(recipe: Path, sample_log: Path, nproc: int = 2) -> subprocess.Popen:
    if nproc == 1:
        cmd, env = _one_process(recipe, sample_log)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    cmd = [
        *torchrun_cmd(nproc),
        # torchrun stops the other workers once one exits non-zero; a slow monitor lets every
        # rank finish its own exit (all of them exit 75 after the same final barrier anyway).
        "--monitor-interval=3",
        INSTRUMENTED,
        "train",
        str(recipe),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMFT_SAMPLE_LOG": str(sample_log)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _reference(root: Path, engine: dict) -> dict:
    recipe = _recipe(root, engine)
    done = torchrun(["train", str(recipe)], env={"LLMFT_SAMPLE_LOG": str(root / "samples")})
    assert done.returncode == 0, done.stderr[-4000:]
    return {"run": root / "run", "samples": sample_log(root / "samples")}


def _stopped(root: Path, engine: dict, *, one_rank: bool = False, nproc: int = 2) -> dict:
    """``nproc`` ranks stopped by SIGTERM after step 2: to rank 1 alone, or to the launcher
    (torchrun forwards it to every rank; a single process is its own launcher)."""
    recipe = _recipe(root, engine)
    proc = _launch(recipe, root / "samples-before", nproc)
    pids = _rank_pids(proc.pid, nproc) if nproc > 1 else {0: proc.pid}
    wait_for_step(root / "run", 2, proc)
    os.kill(pids[1] if one_rank else proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    run = root / "run"
    return {
        "root": root,
        "recipe": recipe,
        "run": run,
        "stderr": err,
        "returncode": proc.returncode,
        "stop_step": _stop_step(run) if (run / "checkpoints/latest").exists() else None,
    }


def _resume(stopped: dict, nproc: int) -> subprocess.CompletedProcess:
    sample_log = stopped["root"] / "samples-after"
    if nproc > 1:
        return torchrun(["train", str(stopped["recipe"])], nproc=nproc, env={"LLMFT_SAMPLE_LOG": str(sample_log)})
    cmd, env = _one_process(stopped["recipe"], sample_log)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _stop_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints/latest").read_text().strip().removeprefix("step-"))


def _assert_same_run(run: Path, reference: dict) -> None:
    """Every step's tokens and loss (a re-run step's later row counts), and the final weights."""
    rows, ref_rows = metrics(run), metrics(reference["run"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, ref in zip(rows, ref_rows, strict=True):
        assert row["tokens"] == ref["tokens"], row["step"]
        assert abs(row["loss"] - ref["loss"]) < TOLERANCE, (row["step"], row["loss"], ref["loss"])
    got = trainable_state(load_checkpoint_model(run)[0])
    want = trainable_state(load_checkpoint_model(reference["run"])[0])
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=TOLERANCE, msg=name)


def _assert_resume_matches(stopped: dict, reference: dict) -> None:
    # losses: steps 1..stop from the first world size, the rest from the second; weights
    _assert_same_run(stopped["run"], reference)
    stop = stopped["stop_step"]
    # samples: what the first world took up to the stop, then what the second took, step by step
    before, after = sample_log(stopped["root"] / "samples-before"), sample_log(stopped["root"] / "samples-after")
    assert sorted(before) == list(range(1, stop + 1))  # nothing taken past the checkpoint
    assert sorted(after) == list(range(stop + 1, STEPS + 1))
    assert {**before, **after} == reference["samples"]
    assert all(sum(c.values()) == GLOBAL_BATCH for c in reference["samples"].values())
    first_epoch = sum((reference["samples"][s] for s in range(1, 9)), Counter())
    assert first_epoch == Counter(range(NUM_SAMPLES))  # each sample exactly once per epoch


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """engine name -> its uninterrupted 2-rank run, made once for every test that compares with it."""
    made: dict[str, dict] = {}

    def reference(name: str) -> dict:
        if name not in made:
            made[name] = _reference(tmp_path_factory.mktemp(f"{name}-reference"), ENGINES[name])
        return made[name]

    return reference


@pytest.fixture(scope="module")
def fsdp_stopped(tmp_path_factory):
    return _stopped(tmp_path_factory.mktemp("fsdp-stopped"), ENGINES["fsdp"], one_rank=True)


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(fsdp_stopped):
    err, stop = fsdp_stopped["stderr"], fsdp_stopped["stop_step"]
    assert 2 <= stop < STEPS, err[-4000:]
    # rank 1 got the signal, rank 0 learned it from the all-reduced flag; both stopped after step `stop`
    assert f"[llmft rank 1] stopped by SIGTERM after step {stop}; checkpoint written" in err, err[-4000:]
    assert f"[llmft rank 0] stopped by a signal on another rank after step {stop}; checkpoint written" in err
    assert "exitcode  : 75" in err or fsdp_stopped["returncode"] == 75, err[-4000:]  # torchrun reports 75
    assert "exitcode  : -" not in err  # no rank was killed by a signal
    run = fsdp_stopped["run"]
    assert (run / f"checkpoints/step-{stop}/COMPLETE").exists()
    assert json.loads((run / f"checkpoints/step-{stop}/trainer_state.json").read_text())["world_size"] == 2
    assert max(r["step"] for r in metrics(run)) == stop


def test_universal_conversion_refuses_a_checkpoint_without_zero_partitions(fsdp_stopped):
    with pytest.raises(UserError, match=r"holds no DeepSpeed ZeRO 1-3 optimizer partitions"):
        deepspeed_universal(fsdp_stopped["run"])
    assert not list((fsdp_stopped["run"] / "checkpoints").glob("*/deepspeed_universal"))


def test_fsdp_two_ranks_stopped_resume_on_one_rank(references, fsdp_stopped):
    done = _resume(fsdp_stopped, nproc=1)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "elastic resume: checkpoint written by 2 process(es), now 1" in done.stderr
    assert "micro 2 x accumulation 4 x data-parallel 1 = global 8" in done.stderr
    _assert_resume_matches(fsdp_stopped, references("fsdp"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("zero1", marks=pytest.mark.extended),
        pytest.param("zero2", marks=pytest.mark.extended),
        "zero3",
        pytest.param("zero3-lora", marks=pytest.mark.extended),
        "zero3-qlora",
        pytest.param("zero3-qlora-pretrained", marks=pytest.mark.extended),
    ],
)
def test_zero_two_ranks_stopped_resume_on_one_rank_via_universal_checkpoint(references, tmp_path, name):
    reference = references(name)
    stopped = _stopped(tmp_path / "stopped", ENGINES[name])  # SIGTERM to torchrun, as SLURM does
    stop = stopped["stop_step"]
    assert stop is not None and 2 <= stop < STEPS, stopped["stderr"][-4000:]
    assert stopped["stderr"].count(f"stopped by SIGTERM after step {stop}; checkpoint written") == 2
    step_dir = stopped["run"] / f"checkpoints/step-{stop}"
    assert not (step_dir / "deepspeed_universal").exists()
    done = _resume(stopped, nproc=1)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "elastic resume: checkpoint written by 2 process(es), now 1" in done.stderr
    assert (step_dir / "deepspeed_universal/state/zero").is_dir()  # converted on the fly, kept for reuse
    assert not list(step_dir.glob(".tmp-*"))
    _assert_resume_matches(stopped, reference)

    # the same conversion on demand, elsewhere
    out = tmp_path / "universal"
    cmd = [sys.executable, "-m", "llmft.checkpoint", "universal", str(step_dir), "--out", str(out)]
    by_hand = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert by_hand.returncode == 0, by_hand.stderr[-4000:]
    assert by_hand.stdout.strip().endswith(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["latest_universal", "state"]
    assert {p.name for p in (out / "state/zero").iterdir()} == {
        p.name for p in (step_dir / "deepspeed_universal/state/zero").iterdir()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_one_rank_stopped_resumes_on_two_ranks(references, tmp_path, name):
    """Growing: a single process is stopped and 2 ranks resume it (accumulation 4 -> 2)."""
    reference = references(name)
    stopped = _stopped(tmp_path / "stopped", ENGINES[name], nproc=1)
    stop = stopped["stop_step"]
    assert stop is not None and 2 <= stop < STEPS, stopped["stderr"][-4000:]
    assert stopped["returncode"] == 75, stopped["stderr"][-4000:]
    assert f"stopped by SIGTERM after step {stop}; checkpoint written" in stopped["stderr"]
    done = _resume(stopped, nproc=2)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "elastic resume: checkpoint written by 1 process(es), now 2" in done.stderr
    assert "micro 2 x accumulation 2 x data-parallel 2 = global 8" in done.stderr
    _assert_resume_matches(stopped, reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "ddp",
        "fsdp",
        pytest.param("zero0", marks=pytest.mark.extended),
        "zero2",
        pytest.param("zero3", marks=pytest.mark.extended),
        "zero3-qlora",
        pytest.param("zero3-qlora-pretrained", marks=pytest.mark.extended),
    ],
)
def test_two_ranks_stopped_resume_on_two_ranks(references, tmp_path, name):
    """The same world size: each engine's own checkpoint format, loaded as written (G4)."""
    reference = references(name)
    stopped = _stopped(tmp_path / "stopped", ENGINES[name])
    stop = stopped["stop_step"]
    assert stop is not None and 2 <= stop < STEPS, stopped["stderr"][-4000:]
    done = _resume(stopped, nproc=2)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"(step {stop}, {stop * GLOBAL_BATCH} samples consumed)" in done.stderr, done.stderr[-4000:]
    assert "elastic resume" not in done.stderr
    assert not (stopped["run"] / f"checkpoints/step-{stop}/deepspeed_universal").exists()
    _assert_resume_matches(stopped, reference)


@pytest.mark.slow
def test_one_rank_killed_mid_save_leaves_the_previous_checkpoint(references, tmp_path):
    """G5 on 2 ranks: rank 1 is SIGKILLed while writing step 4's FSDP2 checkpoint (rank 0
    waits in the barrier before the COMPLETE marker) and torchrun tears the job down. step-2
    stays the latest, complete checkpoint; a 2-rank resume from it ends as the uninterrupted run."""
    recipe = _recipe(tmp_path, ENGINES["fsdp"], checkpoint__every_steps=2, checkpoint__keep_last=2)
    killed = torchrun(
        ["train", str(recipe)],
        env={"LLMFT_FAULT_INJECT": "kill_in_save:4:1", "LLMFT_SAMPLE_LOG": str(tmp_path / "samples-before")},
    )
    assert killed.returncode != 0
    assert "Signals.SIGKILL" in killed.stderr or "exitcode  : -9" in killed.stderr, killed.stderr[-4000:]
    ckpts = tmp_path / "run/checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-2"
    assert (ckpts / "step-2/COMPLETE").exists()
    assert not (ckpts / "step-4").exists()  # never half-visible
    assert (ckpts / ".tmp-step-4").is_dir()  # the interrupted write, replaced when step 4 is saved again

    done = _resume({"root": tmp_path, "recipe": recipe}, nproc=2)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"(step 2, {2 * GLOBAL_BATCH} samples consumed)" in done.stderr, done.stderr[-4000:]
    assert not (ckpts / ".tmp-step-4").exists()
    reference = references("fsdp")
    _assert_same_run(tmp_path / "run", reference)
    # steps 3-4 ran twice, with the same samples; from step 3 on the resumed run took the reference's
    after = sample_log(tmp_path / "samples-after")
    assert sorted(after) == list(range(3, STEPS + 1))
    assert after == {s: c for s, c in reference["samples"].items() if s >= 3}
    assert {s: c for s, c in sample_log(tmp_path / "samples-before").items() if s <= 4} == {
        s: reference["samples"][s] for s in range(1, 5)
    }
