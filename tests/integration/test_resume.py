"""Checkpoints sit on boundaries, resume is exact, a killed job loses nothing (docs/design.md, G3-G5)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
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
@pytest.mark.parametrize("delay", [0.0, pytest.param(0.07, marks=pytest.mark.extended), 0.19])
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


def _plan(tmp_path: Path, *overrides: str, world_size: int | None = None, **sections):
    from llmft.plan.resolve import load_plan

    return load_plan(write_recipe(tmp_path, **sections), list(overrides), world_size=world_size)


def _checkpoint_of(tmp_path: Path, **sections) -> Path:
    """A step dir holding what check_resume_compatible reads: the intent and the plan."""
    from llmft.checkpoint.resume import intent_yaml, plan_yaml

    plan = _plan(tmp_path, **sections)
    step = tmp_path / "ckpt" / "step-2"
    step.mkdir(parents=True)
    (step / "recipe.yaml").write_text(intent_yaml(plan))
    (step / "plan.yaml").write_text(plan_yaml(plan))
    return step


def test_resume_refuses_another_model_adapter_or_data_and_lists_every_difference(tmp_path, llmft_log):
    from llmft.checkpoint.resume import check_resume_compatible

    ckpt = _checkpoint_of(tmp_path)
    plan = _plan(tmp_path, "model.config.hidden_size=128", "peft.method=lora", "data.max_seq_len=32", "run.seed=1")
    with pytest.raises(UserError) as err:
        check_resume_compatible(ckpt, plan)
    message = str(err.value)
    assert message.startswith(f"cannot resume from {ckpt}: the model, adapter or data settings differ")
    assert "checkpoint.resume=never with a new run.output_dir" in message
    for line in (
        "model.config.hidden_size: checkpoint has 64, recipe has 128. Set model.config.hidden_size=64 to resume it.",
        "peft.method: checkpoint has 'none', recipe has 'lora'. Set peft.method=none to resume it.",
        "data.max_seq_len: checkpoint has 64, recipe has 32. Set data.max_seq_len=64 to resume it.",
        "run.seed: checkpoint has 0, recipe has 1. Set run.seed=0 to resume it.",
    ):
        assert f"  - {line}" in message, message
    assert message.count("\n  - ") == 4, message  # nothing else (e.g. the unchanged keys) is listed


@pytest.mark.parametrize(
    "override,logged",
    [
        ("optim.lr=5e-4", "optim.lr 0.001 -> 0.0005"),
        ("train.max_steps=6", "train.max_steps 2 -> 6"),
        ("batch.micro_batch_size=2", "batch.micro_batch_size 4 -> 2"),
    ],
)
def test_resume_allows_and_logs_a_deliberate_change(tmp_path, llmft_log, override, logged):
    from llmft.checkpoint.resume import check_resume_compatible

    ckpt = _checkpoint_of(tmp_path)
    # how this invocation resumes (checkpoint.resume) changes silently
    check_resume_compatible(ckpt, _plan(tmp_path, override, f"checkpoint.resume={ckpt}"))
    messages = [r.getMessage() for r in llmft_log]
    assert messages == [f"resuming with a changed setting: {logged}"]


def test_resume_on_another_world_size_compares_plans_not_recipes(tmp_path, llmft_log):
    """The recipe is the same; the plan re-solves accumulation for 2 processes (elastic resume)."""
    from llmft.checkpoint.resume import check_resume_compatible

    ckpt = _checkpoint_of(tmp_path)
    check_resume_compatible(ckpt, _plan(tmp_path, world_size=2))
    messages = [r.getMessage() for r in llmft_log]
    assert messages == [
        "elastic resume: checkpoint written by 1 process(es), now 2; "
        "micro 4 x accumulation 1 x data-parallel 2 = global 8 (engine single -> fsdp)"
    ]


def test_a_plan_file_that_breaks_the_batch_equation_is_refused_naming_it(tmp_path):
    from llmft.checkpoint.resume import check_resume_compatible

    ckpt = _checkpoint_of(tmp_path)
    text = (ckpt / "plan.yaml").read_text()
    (ckpt / "plan.yaml").write_text(text.replace("global_batch_size: 8", "global_batch_size: 9"))
    with pytest.raises(UserError, match=r"plan.yaml: cannot be read as the plan llmft writes \(ValueError: micro 4"):
        check_resume_compatible(ckpt, _plan(tmp_path))


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_checkpoint_without_a_plan_file_resumes_and_exports(tmp_path, monkeypatch, capsys, kind):
    """tests/fixtures/checkpoints-v1: written by llmft before checkpoints held plan.yaml (the step's
    recipe.yaml is then the resolved recipe, and trainer_state.json holds the batch)."""
    from llmft.export.export import export_model_dir

    work = tmp_path / kind
    shutil.copytree(ROOT / "tests/fixtures/checkpoints-v1" / kind, work)
    monkeypatch.chdir(work)  # the fixture's recipe names its data and run dir relative to its folder
    old = work / "run/checkpoints/step-2"
    assert not (old / "plan.yaml").exists()

    assert train_inproc("recipe.yaml", "train.max_steps=3", "checkpoint.every_steps=1") == 0
    err = capsys.readouterr().err
    assert f"resuming from {Path('run/checkpoints/step-2')} (step 2, 8 samples consumed)" in err
    changed = [line for line in err.splitlines() if "changed setting" in line]
    assert changed == [
        "[llmft] resuming with a changed setting: checkpoint.every_steps 2 -> 1",
        # the fixture's resolved recipe wrote the old key at its old default (30 minutes); now
        # distributed.timeout_s (600 s) holds unless a recipe sets it
        "[llmft] resuming with a changed setting: distributed.timeout_minutes 30 -> None",
        "[llmft] resuming with a changed setting: train.max_steps 2 -> 3",
    ]
    assert [r["step"] for r in metrics(work / "run")] == [1, 2, 3]
    new = work / "run/checkpoints/step-3"
    # a new checkpoint: the recipe as given (auto kept) beside the plan, which llmft train re-solves alike
    from llmft.plan.resolve import load_plan, plan_summary

    assert yaml.safe_load((new / "recipe.yaml").read_text())["batch"]["gradient_accumulation_steps"] == "auto"
    assert yaml.safe_load((new / "plan.yaml").read_text()) == plan_summary(load_plan(new / "recipe.yaml"))
    for step_dir in (old, new):
        out = export_model_dir(step_dir, tmp_path / f"export-{step_dir.name}", merge_lora=kind == "lora")
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    if kind == "lora":
        adapter = export_model_dir(old, tmp_path / "adapter", merge_lora=False)
        assert (adapter / "adapter_model.safetensors").is_file()


def test_resume_with_a_new_lr_and_length_applies_them(tmp_path):
    """LoRA on a model.config base: the base is saved once; a resume takes the new lr and max_steps."""
    from safetensors.torch import load_file

    from llmft.model.build import load_base_model
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
