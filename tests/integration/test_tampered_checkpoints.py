"""Tampered checkpoints are refused, never executed (docs/design.md G7): ``llmft export``
and a resume of ``llmft train`` stop with exit 2 and a message naming the file, and the marker
file the crafted pickle would write never appears. A checkpoint's recipe cannot turn on
``trust_remote_code`` for export."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, TINY_LLAMA, write_recipe

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class WritesMarker:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def _llmft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmft", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300
    )


def _step_dir(tmp_path: Path, engine: str, **recipe_keys) -> Path:
    """A step dir as the engine would leave it, minus the engine state (added by each test)."""
    recipe = yaml.safe_load(write_recipe(tmp_path, **recipe_keys).read_text())
    step = tmp_path / "run/checkpoints/step-1"
    step.mkdir(parents=True)
    (step / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    state = {"step": 1, "samples": 8, "tokens": 1, "epoch": 0.1, "world_size": 2, "engine": engine}
    state |= {"batch": {}, "scheduler": {}}
    (step / "trainer_state.json").write_text(json.dumps(state))
    (step / "COMPLETE").write_text(json.dumps({"step": 1}))
    (tmp_path / "run/checkpoints/latest").write_text("step-1")
    return step


def test_export_refuses_dcp_metadata_that_would_run_code(tmp_path):
    step = _step_dir(tmp_path, "fsdp")
    (step / "dcp").mkdir()
    marker = tmp_path / "marker"
    (step / "dcp/.metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    done = _llmft("export", str(step), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"llmft export: error: {step / 'dcp/.metadata'}: refused: this DCP metadata file names" in done.stderr
    assert "Traceback" not in done.stderr and "weights_only=False" not in done.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_export_refuses_deepspeed_optimizer_states_with_a_foreign_global(tmp_path):
    step = _step_dir(tmp_path, "deepspeed")
    state = step / "deepspeed/state"
    state.mkdir(parents=True)
    marker = tmp_path / "marker"
    torch.save({"module": {}}, state / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": WritesMarker(marker)}, state / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    done = _llmft("export", str(step), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-3000:]
    bad = state / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert f"{bad}: refused: this DeepSpeed file names the Python global(s) builtins.getattr" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()


def _remote_code_model(step: Path, marker: Path) -> None:
    """A full-model checkpoint whose config maps AutoModelForCausalLM to code shipped beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY_LLAMA)
    AutoModelForCausalLM.from_config(config).save_pretrained(step / "model")
    cfg = json.loads((step / "model/config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (step / "model/config.json").write_text(json.dumps(cfg))
    (step / "model/evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('code ran')\n"
        "from transformers import LlamaForCausalLM as Model\n"
    )


def test_export_ignores_trust_remote_code_in_the_checkpoints_recipe(tmp_path):
    step = _step_dir(tmp_path, "single", model__trust_remote_code=True)
    marker = tmp_path / "marker"
    _remote_code_model(step, marker)
    done = _llmft("export", str(step), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "asks for model.trust_remote_code=true; ignored (a checkpoint cannot turn remote code on)" in done.stderr
    assert not marker.exists()
    assert (tmp_path / "out/config.json").exists()
    # the user's own switch is the one that counts: no warning then (a full export streams the weight
    # files without building the model, so even trusted code has nothing to run here)
    done = _llmft("export", str(step), "--out", str(tmp_path / "trusted"), "--trust-remote-code")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ignored" not in done.stderr
    assert not marker.exists()


def _trained_then_tampered(tmp_path: Path, engine: str, manifest: bool = False) -> tuple[Path, Path]:
    """A one-step run's checkpoint. Without ``manifest`` its COMPLETE is rewritten as a checkpoint saved
    before the manifest is (``{"step": 1}``), so the readers' own refusals are what stands between a
    tampered file and its payload; with it, the manifest refuses any file not as saved first."""
    recipe = write_recipe(tmp_path, train__max_steps=1, checkpoint__every_steps=1, distributed__engine=engine)
    done = _llmft("train", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    step = tmp_path / "run/checkpoints/step-1"
    if not manifest:
        (step / "COMPLETE").write_text(json.dumps({"step": 1}))
    return recipe, step


@pytest.mark.slow
def test_resume_refuses_an_optimizer_file_that_would_run_code(tmp_path):
    recipe, step = _trained_then_tampered(tmp_path, "single")
    marker = tmp_path / "marker"
    torch.save({"state": WritesMarker(marker)}, step / "optimizer.pt")
    done = _llmft("train", str(recipe), "train.max_steps=2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{step.resolve() / 'optimizer.pt'}: refused: it holds Python objects" in done.stderr or (
        f"{step / 'optimizer.pt'}: refused: it holds Python objects" in done.stderr
    ), done.stderr[-3000:]
    assert "weights_only=False" not in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_with_the_manifest_a_tampered_optimizer_file_is_damage_and_never_opened(tmp_path):
    recipe, step = _trained_then_tampered(tmp_path, "single", manifest=True)
    marker = tmp_path / "marker"
    torch.save({"state": WritesMarker(marker)}, step / "optimizer.pt")
    done = _llmft("train", str(recipe), "train.max_steps=2", f"checkpoint.resume={step}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{step / 'optimizer.pt'}: is damaged: not the file the checkpoint was saved with (" in done.stderr or (
        f"{step.resolve() / 'optimizer.pt'}: is damaged: not the file the checkpoint was saved with (" in done.stderr
    ), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_fsdp_resume_refuses_dcp_metadata_that_would_run_code(tmp_path):
    recipe, step = _trained_then_tampered(tmp_path, "fsdp")  # FSDP2 in one process (world size 1)
    marker = tmp_path / "marker"
    (step / "dcp/.metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    done = _llmft("train", str(recipe), "train.max_steps=2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "dcp/.metadata: refused: this DCP metadata file names the Python global" in done.stderr, done.stderr[-3000:]
    assert not marker.exists()


def test_export_refuses_a_deepspeed_state_folder_that_is_a_link(tmp_path):
    """Path.rglob does not descend into a linked folder: the scan saw nothing, and zero_to_fp32
    unpickled the files behind the link (the payload ran, export exited 0)."""
    step = _step_dir(tmp_path, "deepspeed")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    marker = tmp_path / "marker"
    torch.save({"module": {}}, elsewhere / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": WritesMarker(marker)}, elsewhere / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (step / "deepspeed").mkdir()
    (step / "deepspeed/state").symlink_to(elsewhere)
    done = _llmft("export", str(step), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"llmft export: error: {step / 'deepspeed/state'}: refused: is a symbolic link (to {elsewhere}); "
        "a checkpoint is read only inside its own folder"
    ) in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_deepspeed_resume_refuses_a_linked_state_folder_and_auto_skips_it(tmp_path):
    """A real ZeRO-1 checkpoint whose deepspeed/state is moved out and linked back, with a payload added
    to its files: named explicitly, the resume is refused; with auto, the checkpoint is skipped (no older
    one: a fresh start). The payload never runs; the linked folder is never written."""
    recipe, step = _trained_then_tampered(tmp_path, "deepspeed")
    marker = tmp_path / "marker"
    elsewhere = tmp_path / "elsewhere"
    (step / "deepspeed/state").rename(elsewhere)
    for f in elsewhere.glob("*.pt"):
        torch.save({**torch.load(f, weights_only=False), "payload": WritesMarker(marker)}, f)
    (step / "deepspeed/state").symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    done = _llmft("train", str(recipe), "train.max_steps=2", f"checkpoint.resume={step}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{step / 'deepspeed/state'}: refused: is a symbolic link (to {elsewhere})" in done.stderr
    assert "Traceback" not in done.stderr
    done = _llmft("train", str(recipe), "train.max_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not resuming from step-1: " in done.stderr and "refused: is a symbolic link" in done.stderr
    assert not marker.exists()
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before
