"""Cluster faults, each with what a user sees (docs/reliability.md; docs/design.md G5, G8, G9):
the run-dir lock, foreign folders, `latest` as a name, damaged checkpoints, write errors during a
save, secrets in compiled files, data smaller than one global batch.

In-process where the fault can be made in-process; the subprocess cases are in
tests/integration/test_faults.py and tests/integration/test_reliability_lock.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import write_recipe

from llmft.checkpoint.layout import latest_checkpoint, resolve_checkpoint
from llmft.checkpoint.verify import DamagedCheckpoint, check_safetensors, check_zip, verify
from llmft.errors import UserError
from llmft.rundir import RunDirLock, check_ours, clear_for_fresh_start


def _step(run: Path, n: int, *, complete: bool = True) -> Path:
    d = run / "checkpoints" / f"step-{n}"
    d.mkdir(parents=True)
    if complete:
        (d / "COMPLETE").write_text(json.dumps({"step": n}))
    return d


# --- one writer per run dir ----------------------------------------------------------------------


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    first = RunDirLock(tmp_path / "run").acquire()
    try:
        with pytest.raises(UserError) as e:
            RunDirLock(tmp_path / "run").acquire()
        msg = str(e.value)
        assert msg.startswith(f"run.output_dir: {tmp_path / 'run'} is in use by another llmft train (pid {os.getpid()}")
        assert "give this one another run.output_dir" in msg
    finally:
        first.release()
    RunDirLock(tmp_path / "run").acquire().release()  # released: free again


# --- never touch what llmft did not write ----------------------------------------------------------


def test_foreign_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "recipe.yaml").write_text("mine too")
    with pytest.raises(UserError) as e:
        check_ours(tmp_path)
    assert "is not empty (notes.txt, recipe.yaml) and is not an llmft run directory" in str(e.value)
    assert (tmp_path / "recipe.yaml").read_text() == "mine too"


def test_llmft_dirs_are_accepted(tmp_path):
    check_ours(tmp_path / "missing")
    (tmp_path / "compiled").mkdir()  # llmft compile's default output
    check_ours(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    _step(tmp_path, 2)  # an llmft run of an older version (no marker yet)
    check_ours(tmp_path)


def test_overwrite_removes_only_llmft_entries_and_logs_them(tmp_path, llmft_log):
    run = tmp_path
    _step(run, 2)
    _step(run, 4, complete=False).rename(run / "checkpoints" / ".tmp-step-4")
    (run / "checkpoints" / "latest").write_text("step-2")
    (run / "checkpoints" / "my-notes.txt").write_text("keep")
    (run / "checkpoints" / "step-x").mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "data.jsonl").write_text("keep")
    clear_for_fresh_start(run)
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["my-notes.txt", "step-x"]
    assert (run / "data.jsonl").exists() and not (run / "metrics.jsonl").exists()
    removed = [r.getMessage() for r in llmft_log]
    assert f"run.overwrite=true: removing {run / 'checkpoints' / 'step-2'}" in removed
    assert len(removed) == 4  # step-2, .tmp-step-4, latest, metrics.jsonl


# --- latest is a name --------------------------------------------------------------------------------


@pytest.mark.parametrize("pointer", ["/etc", "../../outside/step-9", "step-9/../../x", "step-4\nstep-2"])
def test_latest_pointing_outside_the_run_is_ignored(tmp_path, pointer, llmft_log):
    run = tmp_path / "run"
    _step(run, 2)
    outside = _step(tmp_path / "outside", 9)
    (run / "checkpoints" / "latest").write_text(pointer)
    assert latest_checkpoint(run) == run / "checkpoints" / "step-2"
    assert any("not a step-N name" in r.getMessage() for r in llmft_log)
    with pytest.raises(UserError, match="not a step-N name"):
        resolve_checkpoint(run / "checkpoints" / "latest")
    assert outside.exists()


def test_stale_latest_loses_to_the_newest_complete_step(tmp_path, llmft_log):
    run = tmp_path
    for n in (2, 4, 6):
        _step(run, n)
    _step(run, 8, complete=False)
    (run / "checkpoints" / "latest").write_text("step-4")
    assert latest_checkpoint(run) == run / "checkpoints" / "step-6"
    messages = [r.getMessage() for r in llmft_log]
    assert "checkpoints/latest names step-4, but step-6 is the newest complete checkpoint: using step-6" in messages


# --- damaged checkpoints -----------------------------------------------------------------------------


def _real_files(tmp_path: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    st = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(64, 64), "b": torch.zeros(3)}, str(st))
    pt = tmp_path / "o.pt"
    torch.save({"state": {0: {"exp_avg": torch.ones(1000)}}}, pt)
    return {"safetensors": st, "pt": pt}


def test_whole_files_pass_and_truncated_ones_are_named(tmp_path):
    files = _real_files(tmp_path)
    check_safetensors(files["safetensors"])
    check_zip(files["pt"])
    for kind, path in files.items():
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(DamagedCheckpoint) as e:
            (check_safetensors if kind == "safetensors" else check_zip)(path)
        assert str(e.value).startswith(f"{path}: is damaged: ")


def test_marker_must_name_its_own_step(tmp_path):
    d = _step(tmp_path, 4)
    (d / "COMPLETE").write_text(json.dumps({"step": 6}))
    with pytest.raises(DamagedCheckpoint, match="says step 6, but the folder is step-4"):
        verify(d)


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/checkpoints-v1"


def test_trainer_state_writes_and_reads_the_batch_as_a_batch_plan(tmp_path):
    """One serialisation (BatchPlan.to_dict / from_dict); an older llmft's trainer_state.json reads the same."""
    from llmft.checkpoint.layout import TrainerState
    from llmft.plan.batch import BatchPlan

    old = TrainerState.read(FIXTURES / "full/run/checkpoints/step-2")  # written before BatchPlan.to_dict
    assert old.batch == BatchPlan(4, 2, 2, 1) and old.extra == {}
    d = tmp_path / "step-2"
    d.mkdir()
    (d / "trainer_state.json").write_text(old.to_json())
    assert (
        json.loads(old.to_json())["batch"]
        == json.loads((FIXTURES / "full/run/checkpoints/step-2/trainer_state.json").read_text())["batch"]
    )
    assert TrainerState.read(d) == old
    assert BatchPlan.from_dict({**old.batch.to_dict(), "equation": "ignored"}) == old.batch


def test_a_trainer_state_whose_batch_breaks_the_equation_is_damaged(tmp_path):
    d = _step(tmp_path, 2)
    for name in ("trainer_state.json", "recipe.yaml", "plan.yaml"):
        source = FIXTURES / "full/run/checkpoints/step-2" / name
        if source.exists():
            (d / name).write_text(source.read_text())
    state = json.loads((d / "trainer_state.json").read_text())
    state["batch"]["dp_size"] = 2
    (d / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(DamagedCheckpoint, match="micro 2 x accumulation 2 x data-parallel 2 is not global 4"):
        verify(d)


def test_malformed_jsonl_line_reports_its_real_column(tmp_path):
    """The error names file:line and the column json reports for that line (leading spaces included)."""
    from llmft.data import build_data
    from llmft.recipe import load_recipe
    from llmft.tokenizer import byte_tokenizer

    line = '  {"text": "a", "b": }'
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(line)
    (tmp_path / "train.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(UserError) as e:
        build_data(load_recipe(str(write_recipe(tmp_path))), byte_tokenizer())
    assert want.value.colno == 22
    assert str(e.value).startswith(f"{tmp_path / 'train.jsonl'}:2: not valid JSON (Expecting value at column 22)")
