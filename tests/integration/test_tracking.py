"""run.trackers for real: W&B in offline mode and MLflow on a local file store, read back with
their own readers (``wandb leet inspect --json`` on the run's .wandb log, ``MlflowClient``),
TensorBoard with its own EventAccumulator.

What must hold (docs/tracking.md): every train and eval row at its optimizer step; config /
params with the recipe, batch equation, plan and system; a stopped-and-resumed job continues the
same tracked run with steps 1..N exactly once (steps logged after the last checkpoint and re-run
after a kill are skipped: the tracker keeps its first value); a missing extra is a clear error
before any model loads; a tracker that fails is a warning, never a lost step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, metrics, train_inproc, wait_for_step, write_recipe
from trackers import job_cmd, job_env, losses, mlflow_run, mlflow_steps, tracker_env_vars, wandb_segments, wandb_steps

from llmft.errors import UserError

# optional extras (`pip install llmft[wandb,mlflow]`): without them these tests say so and skip
pytest.importorskip("wandb", reason="the wandb extra is not installed")
pytest.importorskip("mlflow", reason="the mlflow extra is not installed")

ALL = ["tensorboard", "wandb", "mlflow"]


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    for k, v in tracker_env_vars(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    return tmp_path


# --- readers: each tracker's own ----------------------------------------------------------------


def _steps(seg: dict) -> list[int]:
    return [int(h["_step"]) for h in seg["history"]]


def tensorboard_steps(run_dir: Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def _close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Same steps, same values (TensorBoard stores float32)."""
    return [s for s, _ in a] == [s for s, _ in b] and all(
        abs(x - y) <= 1e-6 * max(1, abs(y)) for (_, x), (_, y) in zip(a, b, strict=False)
    )


# --- a missing extra, an unknown name -----------------------------------------------------------


def _recipe(tmp_path, *overrides):
    from llmft.recipe import load_recipe

    return load_recipe(write_recipe(tmp_path), list(overrides))


def test_missing_extra_names_what_to_install(tracker_env, monkeypatch):
    from llmft.metrics.trackers import check_available

    tmp_path = tracker_env

    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec sees when it is not installed
    with pytest.raises(UserError) as err:
        check_available(_recipe(tmp_path, "run.trackers=[tensorboard,wandb,mlfow]"))
    text = str(err.value)
    assert "run.trackers: lists wandb, but the wandb package is not installed" in text
    assert 'pip install -e ".[wandb]"' in text
    assert "run.trackers: 'mlfow' is not a tracker. Use any of: tensorboard, wandb, mlflow." in text
    check_available(_recipe(tmp_path, "run.trackers=[tensorboard,mlflow]"))  # these are fine


def test_mlflow_default_store_needs_the_full_package(tmp_path, monkeypatch):
    from importlib.util import find_spec

    from llmft.metrics.trackers import check_available

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = _recipe(tmp_path, "run.trackers=[mlflow]")
    if find_spec("sqlalchemy") is not None:  # full mlflow: its sqlite default works
        check_available(recipe)
        return
    with pytest.raises(UserError, match="is not set, so MLflow uses its default sqlite:///mlflow.db"):
        check_available(recipe)
    check_available(_recipe(tmp_path, "run.trackers=[mlflow]", f"run.mlflow_tracking_uri=file:{tmp_path}/mlruns"))


def test_missing_extra_fails_before_any_model_is_loaded(tmp_path):
    recipe = write_recipe(tmp_path, run__trackers=["wandb"])
    code = "import sys; sys.modules['wandb'] = None; from llmft.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, "train", str(recipe)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert 'the wandb package is not installed. Install the extra: pip install -e ".[wandb]"' in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # nothing was started: no run dir, no model


def test_tensorboard_false_still_switches_it_off(tmp_path):
    from llmft.metrics.trackers import selected

    assert selected(_recipe(tmp_path)) == []  # helpers' recipe: run.tensorboard false
    assert selected(_recipe(tmp_path, "run.tensorboard=true")) == ["tensorboard"]
    assert selected(_recipe(tmp_path, "run.trackers=[wandb,tensorboard]")) == ["wandb"]
    assert selected(_recipe(tmp_path, "run.trackers=[mlflow]", "run.tensorboard=true")) == ["mlflow"]


# --- one run, three trackers --------------------------------------------------------------------


def test_every_row_config_and_summary_reach_all_trackers(tracker_env):
    tmp = tracker_env
    recipe = write_recipe(
        tmp,
        run__trackers=ALL,
        run__tensorboard=True,
        run__name="tiny-tracked",
        train__max_steps=4,
        train__eval_every_steps=2,
        data__eval_fraction=0.1,
    )
    assert train_inproc(recipe) == 0
    run = tmp / "run"
    train, evals = losses(run), losses(run, "eval")
    assert [s for s, _ in train] == [1, 2, 3, 4] and [s for s, _ in evals] == [2, 4]

    (seg,) = wandb_segments(run)
    assert wandb_steps([seg], "train/loss") == train
    assert wandb_steps([seg], "eval/loss") == evals
    assert {"train/lr", "train/grad_norm", "train/tokens", "train/tokens_per_s"} <= set(seg["history"][0])
    assert seg["config"]["batch"]["equation"] == "micro 4 x accumulation 2 x data-parallel 1 = global 8"
    assert seg["config"]["plan"]["engine"] == "single"
    assert seg["config"]["plan"]["world_size"] == 1
    assert seg["config"]["plan"]["memory_estimate_gib"] > 0
    assert seg["config"]["recipe"]["optim"]["lr"] == 1e-3
    assert "torch" in seg["config"]["system"]["versions"]
    assert seg["summary"]["checkpoint"] == str(run / "checkpoints/step-4")
    assert seg["exit_code"] == 0

    client, mrun = mlflow_run(tmp)
    assert mrun.info.run_name == "tiny-tracked" and mrun.info.status == "FINISHED"
    assert mlflow_steps(client, mrun.info.run_id, "train/loss") == train
    assert mlflow_steps(client, mrun.info.run_id, "eval/loss") == evals
    params = mrun.data.params
    assert params["batch.equation"] == "micro 4 x accumulation 2 x data-parallel 1 = global 8"
    assert params["plan.engine"] == "single" and params["recipe.optim.lr"] == "0.001"
    assert params["system.versions.torch"].startswith("2.")
    assert mrun.data.tags["llmft.checkpoint"] == str(run / "checkpoints/step-4")

    assert _close(tensorboard_steps(run, "train/loss"), train)

    state = json.loads((run / "checkpoints/step-4/trainer_state.json").read_text())["trackers"]
    assert state["wandb"]["run_id"] == seg["run_id"]
    assert state["mlflow"]["run_id"] == mrun.info.run_id
    # the checkpoint at step 4 is taken before the final eval row is sent
    assert state["wandb"]["last_step"] == {"train": 4, "eval": 2}


# --- stop and resume: the same tracked run, steps 1..N exactly once -----------------------------


def _assert_each_step_once(tmp: Path, steps: int) -> list[dict]:
    """W&B, MLflow and TensorBoard hold train steps 1..steps once each, with metrics.jsonl's values."""
    run = tmp / "run"
    train = losses(run)
    assert [s for s, _ in train] == list(range(1, steps + 1))
    segments = wandb_segments(run)
    assert len(segments) == 2  # one run, two jobs (a killed job's segment may hold nothing: see below)
    assert len({seg["run_id"] for seg in segments if seg["run_id"]}) == 1
    assert segments[-1]["run_id"] is not None and segments[-1]["exit_code"] == 0
    assert wandb_steps(segments, "train/loss") == train
    client, mrun = mlflow_run(tmp)
    assert mlflow_steps(client, mrun.info.run_id, "train/loss") == train
    assert mrun.info.status == "FINISHED"
    assert _close(tensorboard_steps(run, "train/loss"), train)
    return segments


def test_stop_signal_then_resume_in_process(tracker_env):
    """The fast variant (default suite): SIGTERM to this process once step 3 is logged; the same
    command resumes; W&B, MLflow, TensorBoard hold steps 1..N exactly once, in one tracked run."""
    import threading

    tmp, steps = tracker_env, 30
    recipe = write_recipe(tmp, run__trackers=ALL, run__tensorboard=True, train__max_steps=steps)
    run = tmp / "run"

    def stop_after_step_3():
        deadline = time.time() + 120
        while time.time() < deadline:
            if (run / "metrics.jsonl").exists() and len(metrics(run)) >= 3:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=stop_after_step_3, daemon=True)
    watcher.start()
    assert train_inproc(recipe) == 75
    watcher.join()
    stopped_at = max(r["step"] for r in metrics(run))
    assert 3 <= stopped_at < steps
    assert train_inproc(recipe) == 0
    first, second = _assert_each_step_once(tmp, steps)
    assert _steps(first) == list(range(1, stopped_at + 1))
    assert _steps(second) == list(range(stopped_at + 1, steps + 1))
    state = json.loads((run / f"checkpoints/step-{stopped_at}/trainer_state.json").read_text())["trackers"]
    assert state["wandb"]["run_id"] == first["run_id"] == second["run_id"]


@pytest.mark.slow
def test_sigterm_then_resume_continues_the_same_tracked_run(tmp_path):
    steps = 40
    recipe = write_recipe(tmp_path, run__trackers=ALL, run__tensorboard=True, train__max_steps=steps)
    run = tmp_path / "run"
    # Its own session, signalled as a whole like SLURM does: the W&B service process gets it too.
    proc = subprocess.Popen(
        job_cmd(recipe), stderr=subprocess.PIPE, text=True, env=job_env(tmp_path), cwd=ROOT, start_new_session=True
    )
    wait_for_step(run, 1, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = max(r["step"] for r in metrics(run))
    assert stopped_at < steps

    done = subprocess.run(job_cmd(recipe), capture_output=True, text=True, env=job_env(tmp_path), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wandb: continuing run_id" in done.stderr and "mlflow: continuing run_id" in done.stderr
    first, second = _assert_each_step_once(tmp_path, steps)
    assert _steps(first) == list(range(1, stopped_at + 1))  # closed cleanly on the signal: nothing re-sent
    assert _steps(second) == list(range(stopped_at + 1, steps + 1))


@pytest.mark.slow
def test_kill_after_logged_steps_skips_them_on_resume(tmp_path):
    """Checkpoint at 2; steps 3 and 4 logged, then the job dies inside the save of step 4. The
    resumed job re-runs 3 and 4 (metrics.jsonl gets them twice, the later counts). MLflow and
    TensorBoard stored 3 and 4 when they were sent: they skip the re-run. W&B's service loses
    what it buffered for a killed job, so W&B is sent again, from metrics.jsonl, what it is not
    known to hold (everything up to the checkpoint), then the re-run steps."""
    recipe = write_recipe(
        tmp_path, run__trackers=ALL, run__tensorboard=True, train__max_steps=6, checkpoint__every_steps=2
    )
    killed = subprocess.run(
        job_cmd(recipe),
        capture_output=True,
        text=True,
        env=job_env(tmp_path, LLMFT_FAULT_INJECT="kill_in_save:4"),
        cwd=ROOT,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ledger = json.loads((tmp_path / "run/trackers.json").read_text())
    assert ledger["mlflow"]["durable_step"] == ledger["tensorboard"]["durable_step"] == {"train": 4}
    assert ledger["wandb"]["last_step"] == {"train": 4} and ledger["wandb"]["durable_step"] == {}

    done = subprocess.run(job_cmd(recipe), capture_output=True, text=True, env=job_env(tmp_path), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "step-2" in done.stderr
    logged = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 3, 4, 5, 6]
    first, second = _assert_each_step_once(tmp_path, 6)
    assert _steps(second) == [1, 2, 3, 4, 5, 6]  # 1-2 replayed from metrics.jsonl, 3-6 trained
    client, mrun = mlflow_run(tmp_path)
    by_step = {m.step: m.timestamp for m in client.get_metric_history(mrun.info.run_id, "train/loss")}
    resumed_at = min(h["_timestamp"] for h in second["history"]) * 1000
    assert by_step[4] < resumed_at < by_step[5]  # 3 and 4 are the first job's: skipped on resume


# --- failures are warnings ----------------------------------------------------------------------


def test_a_tracker_that_cannot_start_is_a_warning(tracker_env, monkeypatch, capfd):
    from helpers import free_port

    tmp = tracker_env
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    recipe = write_recipe(tmp, run__trackers=["wandb", "mlflow"], train__max_steps=3)
    assert train_inproc(recipe) == 0
    err = capfd.readouterr().err
    assert "[llmft] tracker mlflow did not start (MlflowException: API request to http://127.0.0.1:" in err
    assert "training goes on, metrics.jsonl has every row" in err
    assert [s for s, _ in losses(tmp / "run")] == [1, 2, 3]
    assert wandb_steps(wandb_segments(tmp / "run"), "train/loss") == losses(tmp / "run")  # the others go on
    state = json.loads((tmp / "run/checkpoints/step-3/trainer_state.json").read_text())["trackers"]
    assert set(state) == {"wandb"}


def test_a_tracker_that_fails_to_send_is_dropped_after_warnings(tracker_env):
    import shutil

    from llmft.metrics.trackers import MAX_FAILURES, Trackers

    tmp = tracker_env
    recipe = _recipe(tmp, "run.trackers=[mlflow,tensorboard]", "run.tensorboard=true")
    (tmp / "run").mkdir()
    trackers = Trackers(tmp / "run", recipe, {"batch": {"equation": "e"}})
    trackers.log({"split": "train", "step": 1, "loss": 2.0})
    shutil.rmtree(tmp / "mlruns")  # the store is gone: every send fails from now on
    for step in range(2, 2 + MAX_FAILURES + 1):
        trackers.log({"split": "train", "step": step, "loss": 1.0})
    assert set(trackers.active) == {"tensorboard"}
    assert trackers.state()["tensorboard"]["last_step"] == {"train": 2 + MAX_FAILURES}
    trackers.close()
    assert [s for s, _ in tensorboard_steps(tmp / "run", "train/loss")] == list(range(1, 3 + MAX_FAILURES))
