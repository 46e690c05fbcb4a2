"""Cluster faults, each with what a user sees (docs/reliability.md; docs/design.md G5, G8, G9):
the run-dir lock, foreign folders, `latest` as a name, damaged checkpoints, write errors during a
save, secrets in compiled files, data smaller than one global batch.

In-process where the fault can be made in-process; the subprocess cases are in
tests/integration/test_faults.py and tests/integration/test_reliability_lock.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers import write_recipe

from llmft.checkpoint.layout import latest_checkpoint, resolve_checkpoint
from llmft.checkpoint.rundir import RunDirLock, check_ours, clear_for_fresh_start
from llmft.checkpoint.verify import DamagedCheckpoint, check_checkpoint, check_safetensors, check_zip
from llmft.errors import UserError


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
        check_checkpoint(d)


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
        check_checkpoint(d)


def test_malformed_jsonl_line_reports_its_real_column(tmp_path):
    """The error names file:line and the column json reports for that line (leading spaces included)."""
    from llmft.data import build_data
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.recipe import load_recipe

    line = '  {"text": "a", "b": }'
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(line)
    (tmp_path / "train.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(UserError) as e:
        build_data(load_recipe(str(write_recipe(tmp_path))), byte_tokenizer())
    assert want.value.colno == 22
    assert str(e.value).startswith(f"{tmp_path / 'train.jsonl'}:2: not valid JSON (Expecting value at column 22)")


# --- checkpoints validated as data (round 2) ---------------------------------------------------------


def _whole_step(run: Path, n: int, **state) -> Path:
    """A complete step dir with the files verify reads (no engine state)."""
    d = _step(run, n)
    fields = {"step": n, "samples": 8 * n, "tokens": 10 * n, "epoch": 0.5, "world_size": 1, "engine": "single"}
    (d / "trainer_state.json").write_text(json.dumps({**fields, "batch": {}, "scheduler": {}, **state}))
    (d / "recipe.yaml").write_text("run: {seed: 0}\n")
    return d


@pytest.mark.parametrize(
    "state, said",
    [
        ({"samples": None}, "field 'samples' is null, not a JSON int"),
        ({"step": True}, "field 'step' is true, not a JSON int"),
        ({"epoch": "half"}, "field 'epoch' is \"half\", not a JSON int or float"),
        ({"scheduler": []}, "field 'scheduler' is [], not a JSON dict"),
        ({"tokens": -1}, "field 'tokens' is -1, below 0"),
        ({"world_size": 0}, "field 'world_size' is 0, below 1"),
    ],
)
def test_trainer_state_fields_are_type_checked(tmp_path, state, said):
    d = _whole_step(tmp_path, 2, **state)
    with pytest.raises(DamagedCheckpoint) as e:
        check_checkpoint(d)
    assert str(e.value).startswith(f"{d / 'trainer_state.json'}: is damaged: cannot be read as llmft trainer state")
    assert said in str(e.value)


@pytest.mark.parametrize("content", ["[1, 2]", '"step-2"', "null"])
def test_trainer_state_that_is_not_an_object_is_damaged_not_a_traceback(tmp_path, content):
    d = _whole_step(tmp_path, 2)
    (d / "trainer_state.json").write_text(content)
    with pytest.raises(DamagedCheckpoint, match=r"holds a JSON \w+, not an object of named fields"):
        check_checkpoint(d)


def test_trainer_state_must_agree_with_its_folder(tmp_path):
    d = _whole_step(tmp_path, 4, step=6)
    with pytest.raises(DamagedCheckpoint) as e:
        check_checkpoint(d)
    assert str(e.value).startswith(f"{d / 'trainer_state.json'}: is damaged: says step 6, but the folder is step-4")


@pytest.mark.parametrize("marker", [{"step": True}, {"step": 1.0}, {"step": "1"}])
def test_marker_step_is_a_json_integer(tmp_path, marker):
    d = _whole_step(tmp_path, 1)
    (d / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(DamagedCheckpoint, match="but the folder is step-1"):
        check_checkpoint(d)


@pytest.mark.parametrize(
    "entry",
    [{"dtype": "F32", "shape": [3]}, {"shape": [3], "data_offsets": [0, 12]}, {"dtype": "F32", "data_offsets": 5}],
)
def test_safetensors_header_entry_missing_a_field_is_named(tmp_path, entry):
    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    with pytest.raises(DamagedCheckpoint) as e:
        check_safetensors(path)
    assert str(e.value).startswith(f"{path}: is damaged: unreadable safetensors header (tensor 'w' lacks a dtype")


# --- a checkpoint is read only inside itself ---------------------------------------------------------


def test_a_link_inside_a_checkpoint_is_refused(tmp_path):
    d = _whole_step(tmp_path / "run", 2)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (d / "model").symlink_to(outside)
    with pytest.raises(DamagedCheckpoint) as e:
        check_checkpoint(d)
    assert str(e.value).startswith(
        f"{d / 'model'}: refused: is a symbolic link (to {outside}); a checkpoint is read only inside its own folder"
    )


def test_a_fifo_inside_a_checkpoint_is_refused_not_waited_on(tmp_path):
    d = _whole_step(tmp_path / "run", 2)
    os.mkfifo(d / "optimizer.pt")
    with pytest.raises(DamagedCheckpoint, match="optimizer.pt: refused: is not a plain file or folder"):
        check_checkpoint(d)


def test_a_step_dir_linked_outside_the_run_is_refused(tmp_path):
    real = _whole_step(tmp_path / "other", 2)
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    link = tmp_path / "run/checkpoints/step-2"
    link.symlink_to(real)
    with pytest.raises(DamagedCheckpoint) as e:
        check_checkpoint(link)
    assert str(e.value).startswith(f"{link}: refused: is a symbolic link to {real}, outside {link.parent}")


def test_deepspeed_scan_sees_files_behind_a_linked_folder(tmp_path):
    """Path.rglob does not descend into a linked folder (Python 3.11); DeepSpeed's open does."""
    import torch

    from llmft.engines.safe_deepspeed import check_deepspeed_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"optimizer_state_dict": os.system}, elsewhere / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "step-1/deepspeed").mkdir(parents=True)
    (tmp_path / "step-1/deepspeed/state").symlink_to(elsewhere)
    with pytest.raises(UserError) as e:
        check_deepspeed_files(tmp_path / "step-1")
    assert str(e.value).startswith(f"{tmp_path / 'step-1/deepspeed/state'}: refused: is a symbolic link")


# --- the run lock belongs to one process -------------------------------------------------------------


def test_dcp_metadata_naming_a_file_outside_its_folder_is_refused(tmp_path):
    """DCP's reader opens ``folder / relative_path`` for each entry of ``.metadata``."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from llmft.engines import safe_dcp

    path = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path), no_dist=True)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../secret.distcp"
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UserError) as e:
        safe_dcp.load({"w": torch.zeros(3)}, path, no_dist=True)
    assert str(e.value).startswith(
        f"{path / '.metadata'}: refused: names the data file '../../../secret.distcp', which is not a file of its own"
    )


def test_a_missing_model_folder_is_damage_not_a_file_not_found_mid_resume(tmp_path):
    """Found by the checkpoint harness (tests/integration/test_checkpoint_fuzz.py)."""
    d = _whole_step(tmp_path, 2)
    with pytest.raises(DamagedCheckpoint) as e:
        check_checkpoint(d)
    assert str(e.value).startswith(f"{d / 'model/config.json'}: is damaged: missing")


def test_a_torch_file_with_a_changed_first_byte_is_damage_not_an_index_error(tmp_path):
    """Found by the checkpoint harness: the zip index is intact, but torch.load takes the file for its
    legacy format and fails inside the unpickler."""
    from llmft.checkpoint.safe_load import torch_load

    path = _real_files(tmp_path)["pt"]
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match="does not start with a zip entry"):
        check_zip(path)
    with pytest.raises(UserError) as e:
        torch_load(path)
    assert str(e.value).startswith(f"{path}: is damaged: torch.load cannot read it (")


def test_waiting_for_another_cache_builder_is_bounded_and_says_what_it_waits_for(tmp_path, llmft_log, monkeypatch):
    """A data cache build held by another process (here: another descriptor of this one) is waited
    for a bounded time, then refused naming the entry and the lock (was a blocking flock: forever)."""
    import fcntl
    import logging

    monkeypatch.setattr(logging.getLogger("llmft"), "level", logging.INFO)

    from llmft.data.cache import _locked

    lock = tmp_path / "k.lock"
    with open(lock, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(UserError) as e:
            with _locked(lock, tmp_path / "k", wait_s=1):
                pass
    assert str(e.value).startswith(f"data.cache_dir: waited 0 min for another process to build {tmp_path / 'k'}")
    # The first wait is logged at once; on a loaded machine "at once" may already read 1 s.
    waits = [r.getMessage() for r in llmft_log if r.getMessage().startswith("data cache: waiting (")]
    assert waits and re.fullmatch(
        rf"data cache: waiting \([01] s so far\) for another process to build {re.escape(str(tmp_path / 'k'))}",
        waits[0],
    ), waits


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("attention_bias", None, "not a valid llama config ("),
        ("hidden_size", [], "hidden_size is [], not a whole number"),
        ("num_attention_heads", 0, "num_attention_heads is 0, below 1"),  # was a ZeroDivisionError in export
        ("vocab_size", 10**15, "vocab_size is about 10**15, above the 16,777,216 llmft accepts"),
    ],
)
def test_a_model_config_field_of_the_wrong_type_is_damage(tmp_path, field, value, what):
    """Found by the checkpoint harness: export met transformers' validation error as a traceback."""
    from helpers import TINY_LLAMA
    from transformers import AutoConfig

    from llmft.checkpoint.verify import check_model_config

    AutoConfig.for_model(**TINY_LLAMA).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    check_model_config(path)
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(DamagedCheckpoint) as e:
        check_model_config(path)
    assert str(e.value).startswith(f"{path}: is damaged: {what}")


@pytest.mark.parametrize("config", [{}, {"model_type": 3}])
def test_a_model_config_without_a_model_type_is_damage(tmp_path, config):
    """Found by the checkpoint harness: `{}` as model/config.json reached AutoConfig in export as a
    traceback ("Unrecognized model ... Should have a `model_type` key")."""
    from llmft.checkpoint.verify import check_model_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(DamagedCheckpoint) as e:
        check_model_config(path)
    assert str(e.value) == (
        f"{path}: is damaged: has no model_type. Resume from an earlier checkpoint "
        "(checkpoint.resume=auto skips damaged ones), or restore the file."
    )


@pytest.mark.parametrize(
    "file, damage",
    [
        ("tokenizer.json", {"added_tokens": None}),
        ("tokenizer.json", {"added_tokens": {}}),
        ("chat_template.jinja", b"\xfb"),
    ],
    ids=["added-tokens-null", "added-tokens-map", "template-not-utf8"],
)
def test_a_checkpoint_tokenizer_that_does_not_load_is_damage(tmp_path, file, damage):
    """Found by the checkpoint harness: export loads the checkpoint's tokenizer (a score head's
    config takes its pad token), and a damaged tokenizer file reached it as a traceback."""
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.export.export import _step_tokenizer

    folder = tmp_path / "tokenizer"
    byte_tokenizer().save_pretrained(folder)
    assert _step_tokenizer(tmp_path).pad_token_id is not None
    path = folder / file
    if isinstance(damage, bytes):
        path.write_bytes(damage + path.read_bytes()[1:])
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **damage}))
    with pytest.raises(DamagedCheckpoint) as e:
        _step_tokenizer(tmp_path)
    assert str(e.value).startswith(f"{folder}: is damaged: the tokenizer does not load (")
    assert str(e.value).endswith(
        "Resume from an earlier checkpoint (checkpoint.resume=auto skips damaged ones), or restore the file."
    )


@pytest.mark.parametrize("doc", ["null", "[]", '"text"', "3"])
def test_a_model_json_file_that_is_not_an_object_is_damage(tmp_path, doc):
    """Found by the checkpoint fuzzer: a generation_config.json of `null` reached export as a
    TypeError traceback."""
    from llmft.checkpoint.verify import check_json

    path = tmp_path / "generation_config.json"
    path.write_text(doc)
    with pytest.raises(DamagedCheckpoint) as e:
        check_json(path)
    assert str(e.value).startswith(f"{path}: is damaged: not a JSON object")
