"""Faults a shared cluster produces, each asserted as a user sees it: exit code, message, and the
files on disk before and after (docs/reliability.md; docs/design.md G5, G8)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import INSTRUMENTED, ROOT, checkpoint_weights, metrics, train_inproc, write_data, write_recipe

from llmft.errors import UserError

CKPT = {"checkpoint__every_steps": 2, "checkpoint__keep_last": None, "train__max_steps": 6}


def _cmd(recipe: Path, *overrides: str) -> list[str]:
    return [sys.executable, INSTRUMENTED, "train", str(recipe), *overrides]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_second_run_in_the_same_dir_is_refused_and_the_first_is_untouched(tmp_path):
    recipe = write_recipe(tmp_path, train__max_steps=400, checkpoint__every_steps=100)
    first = subprocess.Popen(_cmd(recipe), stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run/metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline, "first run did not start"
            time.sleep(0.05)
        second = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another llmft train (pid {first.pid} on " in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 75, err[-2000:]
    steps = [r["step"] for r in metrics(tmp_path / "run")]
    raw = [line for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(raw) == len(steps)  # no row written twice


def test_a_fresh_run_never_writes_into_a_folder_of_the_users(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "recipe.yaml").write_text("my own notes\n")
    (mine / "checkpoints/step-1").mkdir(parents=True)
    (mine / "checkpoints/step-1/weights.bin").write_bytes(b"mine")
    before = _tree(mine)
    with pytest.raises(UserError, match=r"is not empty \(checkpoints, recipe.yaml\) and is not an llmft run"):
        train_inproc(write_recipe(tmp_path, run__output_dir=str(mine)))
    assert _tree(mine) == before


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    recipe = write_recipe(tmp_path, **{**CKPT, "train__max_steps": 4})
    assert train_inproc(recipe) == 0
    ckpts = tmp_path / "run/checkpoints"
    damaged = ckpts / "step-4/model/model.safetensors"
    _truncate(damaged)
    capsys.readouterr()
    assert train_inproc(recipe, "train.max_steps=6") == 0
    err = capsys.readouterr().err
    assert f"not resuming from step-4: {damaged}: is damaged:" in err
    assert f"resuming from {ckpts / 'step-2'} (step 2," in err
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4", "step-6"]
    checkpoint_weights(ckpts / "step-4")  # saved again, whole, when the run passed step 4
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def test_a_damaged_checkpoint_named_explicitly_is_refused(tmp_path):
    recipe = write_recipe(tmp_path, **{**CKPT, "train__max_steps": 2})
    assert train_inproc(recipe) == 0
    step = tmp_path / "run/checkpoints/step-2"
    _truncate(step / "optimizer.pt")
    before = _tree(tmp_path / "run/checkpoints")
    with pytest.raises(UserError) as e:
        train_inproc(recipe, f"checkpoint.resume={step}", "train.max_steps=4")
    assert str(e.value).startswith(f"{step / 'optimizer.pt'}: is damaged: not a whole torch.save file")
    assert "weights_only" not in str(e.value)
    assert _tree(tmp_path / "run/checkpoints") == before


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead

    return apply


def test_a_write_error_during_save_keeps_the_previous_checkpoint(tmp_path):
    """The file-size limit makes the model file of step 4 fail to write, as a full disk does."""
    recipe = write_recipe(tmp_path, **{**CKPT, "train__max_steps": 4, "checkpoint__every_steps": 2})
    assert train_inproc(recipe, "train.max_steps=2") == 0
    ckpts = tmp_path / "run/checkpoints"
    before = _tree(ckpts)
    size = (ckpts / "step-2/model/model.safetensors").stat().st_size
    done = subprocess.run(
        _cmd(recipe),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
        preexec_fn=_limit_file_size(size // 2),
    )
    assert done.returncode == 74, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"{ckpts / '.tmp-step-4'}: writing the checkpoint of step 4 failed: File too large" in done.stderr
    assert "GiB free there. The partial checkpoint was removed; step-2 and latest are untouched" in done.stderr
    assert not (ckpts / ".tmp-step-4").exists()
    assert _tree(ckpts) == before  # step-2 and latest byte for byte
    again = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (ckpts / "latest").read_text() == "step-4"


def test_environment_values_stay_unresolved_in_written_recipes(tmp_path):
    secret = "hunter2-not-on-disk"
    write_data(tmp_path / "train.jsonl")
    recipe = write_recipe(tmp_path, run__name="${oc.env:LLMFT_TEST_SECRET}", train__max_steps=2)
    compiled = tmp_path / "compiled"
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "compile", str(recipe), "--out", str(compiled)],
        capture_output=True,
        text=True,
        env=_env(LLMFT_TEST_SECRET=secret),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load((compiled / "recipe.yaml").read_text())["run"]["name"] == "${oc.env:LLMFT_TEST_SECRET}"
    done = subprocess.run(_cmd(compiled), capture_output=True, text=True, env=_env(LLMFT_TEST_SECRET=secret), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for root in (compiled, tmp_path / "run"):
        leaked = [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        assert not leaked, leaked
    assert "${oc.env:LLMFT_TEST_SECRET}" in (tmp_path / "run/checkpoints/step-2/recipe.yaml").read_text()


def test_data_smaller_than_one_global_batch_is_refused(tmp_path):
    write_data(tmp_path / "train.jsonl", n=6)
    with pytest.raises(UserError) as e:
        train_inproc(write_recipe(tmp_path))
    assert str(e.value) == (
        "batch.global_batch_size: is 8, but the data has only 6 training sequences: one optimizer step would "
        "take some of them twice. Use a global batch of at most 6 sequences, or more data."
    )


# --- round 2: checkpoints validated as data, read only inside themselves, nothing waits forever ---------


def _trained(tmp_path: Path, steps: int = 4, **keys) -> tuple[Path, Path]:
    """A run with a checkpoint every 2 steps up to ``steps``: (recipe, checkpoints/)."""
    recipe = write_recipe(tmp_path, **{**CKPT, "train__max_steps": steps, **keys})
    assert train_inproc(recipe) == 0
    return recipe, tmp_path / "run/checkpoints"


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("samples", None, "field 'samples' is null, not a JSON int"),  # hung: the workers outlived the error
        ("step", 6, "says step 6, but the folder is step-4"),  # was "nothing to do", exit 0, steps 5-6 untrained
    ],
)
def test_a_trainer_state_that_is_not_what_llmft_wrote_falls_back_with_workers_running(tmp_path, field, value, said):
    recipe, ckpts = _trained(tmp_path)
    state_file = ckpts / "step-4/trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, field: value}))
    done = subprocess.run(
        _cmd(recipe, "train.max_steps=6", "data.num_workers=1"),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"not resuming from step-4: {state_file}: is damaged: " in done.stderr
    assert said in done.stderr
    assert f"resuming from {ckpts / 'step-2'} (step 2," in done.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def test_a_step_dir_linked_outside_the_run_is_not_resumed_from(tmp_path, capsys):
    recipe, ckpts = _trained(tmp_path)
    outside = tmp_path / "elsewhere/step-4"
    outside.parent.mkdir()
    (ckpts / "step-4").rename(outside)
    (ckpts / "step-4").symlink_to(outside)
    before = _tree(outside)
    capsys.readouterr()
    assert train_inproc(recipe, "train.max_steps=6") == 0
    err = capsys.readouterr().err
    assert f"not resuming from step-4: {ckpts / 'step-4'}: refused: is a symbolic link to {outside}, outside" in err
    assert f"resuming from {ckpts / 'step-2'} (step 2," in err
    assert _tree(outside) == before  # never read as a checkpoint, never written or removed
    assert not (ckpts / "step-4").is_symlink() and (ckpts / "step-4/COMPLETE").is_file()  # saved again, whole


def test_resuming_with_another_optimizer_starts_it_fresh_and_says_so(tmp_path, capsys):
    """Was ``KeyError: 'betas'`` (AdamW's state loaded into SGD, or the reverse)."""
    recipe, ckpts = _trained(tmp_path, steps=2)
    capsys.readouterr()
    assert train_inproc(recipe, "optim.name=sgd", "train.max_steps=4") == 0
    err = capsys.readouterr().err
    assert (
        "optim.name changed adamw -> sgd: the checkpoint's adamw state is not loaded; sgd starts with fresh state at "
        "step 2 (weights, schedule position, data position and RNG are restored)"
    ) in err
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_a_checkpoint_recipe_with_an_unset_environment_value_resumes(tmp_path, capsys, monkeypatch):
    """The checkpoint's recipe keeps ``${oc.env:...}`` as written; resuming where it is unset compares it
    as text (was an omegaconf traceback)."""
    monkeypatch.setenv("LLMFT_TEST_NAME", "from-env")
    recipe, ckpts = _trained(tmp_path, steps=2, run__name="${oc.env:LLMFT_TEST_NAME}")
    monkeypatch.delenv("LLMFT_TEST_NAME")
    capsys.readouterr()
    assert train_inproc(recipe, "run.name=plain", "train.max_steps=4") == 0
    err = capsys.readouterr().err
    assert "resuming with a changed setting: run.name '${oc.env:LLMFT_TEST_NAME}' -> 'plain'" in err


@pytest.mark.parametrize("where", ["mkdir", "commit"])
def test_an_os_error_on_the_checkpoint_path_is_a_message(tmp_path, monkeypatch, where):
    """A read-only or vanished checkpoints/ (as root, chmod cannot make one: the call fails instead),
    when the step folder is made or when it is renamed into place."""
    import errno
    import os as _os
    import pathlib

    from llmft.checkpoint.manager import CheckpointWriteError

    recipe, ckpts = _trained(tmp_path, steps=2)
    before = _tree(ckpts)
    real_mkdir, real_replace = pathlib.Path.mkdir, _os.replace

    def mkdir(self, *a, **k):
        if where == "mkdir" and self.name == ".tmp-step-4":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    def replace(src, dst):
        if where == "commit" and Path(dst).name == "step-4":
            raise OSError(errno.EACCES, "Permission denied", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    monkeypatch.setattr(_os, "replace", replace)
    with pytest.raises(CheckpointWriteError) as e:
        train_inproc(recipe, "train.max_steps=4")
    why = "Read-only file system" if where == "mkdir" else "Permission denied"
    assert str(e.value).startswith(f"{ckpts / '.tmp-step-4'}: writing the checkpoint of step 4 failed: {why}")
    assert "step-2 and latest are untouched" in str(e.value)
    assert _tree(ckpts) == before


def test_kill9_of_the_trainer_while_its_data_worker_lives_does_not_block_the_requeue(tmp_path):
    """The OOM killer's kill -9 hits the training process; its DataLoader worker (stopped here, so it
    cannot exit on its own) lives on. It never held the run dir's lock: the requeued job starts."""
    recipe = write_recipe(tmp_path, train__max_steps=400, checkpoint__every_steps=1, data__num_workers=1)
    first = subprocess.Popen(_cmd(recipe), stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    worker = None
    try:
        deadline = time.time() + 180
        while not (tmp_path / "run/checkpoints/step-1/COMPLETE").exists():
            assert first.poll() is None and time.time() < deadline, "first run did not checkpoint"
            time.sleep(0.05)
        children = Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()
        assert children, "no DataLoader worker"
        worker = int(children[0])
        os.kill(worker, signal.SIGSTOP)
        first.kill()
        first.wait()
        os.kill(worker, 0)  # alive, holding whatever it inherited
        again = subprocess.run(
            _cmd(recipe, "train.max_steps=2"), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=240
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert "in use by another llmft train" not in again.stderr
        assert "resuming from" in again.stderr
    finally:
        first.kill()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
