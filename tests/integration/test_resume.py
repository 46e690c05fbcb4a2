"""Checkpoints sit on boundaries, resume is exact, a killed job loses nothing (docs/design.md, G3-G5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    INSTRUMENTED,
    ROOT,
    checkpoint_weights,
    metrics,
    train_inproc,
    wait_for_step,
    write_data,
    write_recipe,
)

from llmft.errors import UserError

# LoRA with dropout, shuffle and packing on; 40 records packed into ~12 rows of 64 tokens and a
# global batch of 4 rows, so 8 steps cross at least two epoch boundaries.
EXACT = dict(
    peft__method="lora",
    peft__dropout=0.1,
    peft__r=4,
    data__packing=True,
    data__shuffle=True,
    batch__global_batch_size=4,
    batch__micro_batch_size=2,
    train__max_steps=8,
    checkpoint__every_steps=2,
    checkpoint__keep_last=2,
)


def _cmd(recipe: Path, *overrides: str) -> list[str]:
    return [sys.executable, INSTRUMENTED, "train", str(recipe), *overrides]  # LLMFT_FAULT_INJECT, below


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _reference(tmp_path: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    ref = tmp_path / "ref"
    write_data(ref / "train.jsonl", n=40)
    recipe = write_recipe(ref, **EXACT)
    done = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return metrics(ref / "run"), checkpoint_weights(ref / "run/checkpoints/step-8")


def _assert_same_run(run_dir: Path, ref_rows: list[dict], ref_weights: dict[str, torch.Tensor]) -> None:
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]  # bit for bit
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in ref_rows]
    weights = checkpoint_weights(run_dir / "checkpoints/step-8")
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], ref_weights[k]), k


@pytest.mark.slow
def test_sigterm_then_resume_is_bit_exact(tmp_path):
    ref_rows, ref_weights = _reference(tmp_path)
    run = tmp_path / "stopped"
    write_data(run / "train.jsonl", n=40)
    recipe = write_recipe(run, **EXACT)
    proc = subprocess.Popen(_cmd(recipe), stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    wait_for_step(run / "run", 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert "checkpoint written" in err
    stopped_at = max(r["step"] for r in metrics(run / "run"))
    assert stopped_at < 8
    assert (run / "run/checkpoints" / f"step-{stopped_at}" / "COMPLETE").exists()  # on the boundary
    done = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {run / 'run/checkpoints'}/step-{stopped_at}" in done.stderr
    _assert_same_run(run / "run", ref_rows, ref_weights)


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    run = tmp_path / "killed"
    write_data(run / "train.jsonl", n=40)
    recipe = write_recipe(run, **EXACT)
    proc = subprocess.run(
        _cmd(recipe),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=_env(LLMFT_FAULT_INJECT="kill_in_save:4"),
    )
    assert proc.returncode == -signal.SIGKILL
    ckpts = run / "run/checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-2"
    assert (ckpts / "step-2" / "COMPLETE").exists()
    assert not (ckpts / "step-4").exists()  # never half-visible
    assert (ckpts / ".tmp-step-4").exists()  # the interrupted write, ignored and replaced on resume
    done = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "step-2" in done.stderr
    assert (ckpts / "latest").read_text().strip() == "step-8"
    assert not (ckpts / ".tmp-step-4").exists()
    # keep_last 2, plus the checkpoint this run resumed from (never pruned by the run that uses it)
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == ["step-2", "step-6", "step-8"]


@pytest.mark.slow
# fixed kill points after step 3 (the later ones may fall inside a save), so a failure reruns the same way
@pytest.mark.parametrize("delay", [0.0, 0.07, 0.19])
def test_kill9_at_random_moment_then_resume_is_bit_exact(tmp_path, delay):
    ref_rows, ref_weights = _reference(tmp_path)
    run = tmp_path / "kill9"
    write_data(run / "train.jsonl", n=40)
    recipe = write_recipe(run, **EXACT)
    proc = subprocess.Popen(_cmd(recipe), stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    wait_for_step(run / "run", 3, proc)
    time.sleep(delay)
    proc.kill()
    proc.wait()
    done = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_run(run / "run", ref_rows, ref_weights)


def test_fresh_run_never_destroys_old_one(tmp_path):
    recipe = write_recipe(tmp_path, train__max_steps=1)
    ok = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    again = subprocess.run(
        _cmd(recipe, "checkpoint.resume=never"), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300
    )
    assert again.returncode == 2
    assert "checkpoint.resume: is never, but" in again.stderr and "run.overwrite=true" in again.stderr
    assert "Traceback" not in again.stderr
    assert (tmp_path / "run/checkpoints/step-1/COMPLETE").exists()


# --- what a resume may change (G4: same model, adapter and data; deliberate changes logged) -----


def _checkpoint_of(tmp_path: Path, **sections) -> Path:
    """A step dir holding only the resolved recipe: all check_resume_compatible reads."""
    step = tmp_path / "ckpt" / "step-2"
    step.mkdir(parents=True)
    (step / "recipe.yaml").write_text(_recipe_with(tmp_path, **sections))
    return step


def _recipe_with(tmp_path: Path, *overrides: str, **sections) -> str:
    """The resolved recipe of a run (what it writes as recipe.yaml)."""
    from llmft.plan.resolve import load_plan
    from llmft.recipe import to_yaml

    return to_yaml(load_plan(write_recipe(tmp_path, **sections), list(overrides)).resolved_recipe())


def test_resume_refuses_another_model_adapter_or_data_and_lists_every_difference(tmp_path, llmft_log):
    from llmft.run import check_resume_compatible

    ckpt = _checkpoint_of(tmp_path)
    recipe = _recipe_with(
        tmp_path, "model.config.hidden_size=128", "peft.method=lora", "data.max_seq_len=32", "run.seed=1"
    )
    with pytest.raises(UserError) as err:
        check_resume_compatible(ckpt, recipe)
    message = str(err.value)
    assert message.startswith(f"cannot resume from {ckpt}: the model, adapter or data settings differ")
    assert "checkpoint.resume=never with a new run.output_dir" in message
    for line in (
        "model.config.hidden_size: checkpoint has 64, recipe has 128",
        "peft.method: checkpoint has 'none', recipe has 'lora'",
        "data.max_seq_len: checkpoint has 64, recipe has 32",
        "run.seed: checkpoint has 0, recipe has 1",
    ):
        assert f"  - {line}" in message, message
    assert message.count("\n  - ") == 4, message  # nothing else (e.g. the unchanged keys) is listed


@pytest.mark.parametrize(
    "override,logged",
    [("optim.lr=5e-4", "optim.lr 0.001 -> 0.0005"), ("train.max_steps=6", "train.max_steps 2 -> 6")],
)
def test_resume_allows_and_logs_a_deliberate_change(tmp_path, llmft_log, override, logged):
    from llmft.run import check_resume_compatible

    ckpt = _checkpoint_of(tmp_path)
    # the world layout (accumulation re-solved) and the resume setting itself change silently
    recipe = _recipe_with(tmp_path, override, "batch.micro_batch_size=2", f"checkpoint.resume={ckpt}")
    check_resume_compatible(ckpt, recipe)
    messages = [r.getMessage() for r in llmft_log]
    assert messages == [f"resuming with a changed setting: {logged}"]


def test_resume_with_a_new_lr_and_length_applies_them(tmp_path):
    """LoRA on a model.config base: the base is saved once; a resume takes the new lr and max_steps."""
    from safetensors.torch import load_file

    from llmft.model import load_base_model
    from llmft.recipe import load_recipe

    recipe = write_recipe(tmp_path, peft__method="lora", peft__r=4, optim__scheduler="constant")
    assert train_inproc(recipe) == 0
    base_dir = tmp_path / "run/checkpoints/base_model"
    saved = load_file(base_dir / "model.safetensors")
    seeded = load_base_model(load_recipe(recipe)).state_dict()
    assert saved.keys() <= seeded.keys()
    assert all(torch.equal(saved[k], seeded[k]) for k in saved)  # the base the adapter was trained on
    stamp = (base_dir / "model.safetensors").stat().st_mtime_ns

    assert train_inproc(recipe, "optim.lr=5e-4", "train.max_steps=4") == 0
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 5e-4, 5e-4]
    assert (tmp_path / "run/checkpoints/step-4/COMPLETE").exists()
    assert (base_dir / "model.safetensors").stat().st_mtime_ns == stamp  # a resume does not rewrite it

    with pytest.raises(UserError, match=r"peft.r: checkpoint has 4, recipe has 8"):
        train_inproc(recipe, "peft.r=8", "train.max_steps=6")
