"""Reading what llmft sent to W&B and MLflow, with their own readers (``wandb leet inspect --json`` on
the run's .wandb log, ``MlflowClient``), and starting a tracked job as a cluster would: shared by
tests/integration/test_tracking.py and tests/distributed/test_tracking_ranks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import INSTRUMENTED, metrics


def tracker_env_vars(tmp: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{tmp / 'mlruns'}",
        "MLFLOW_EXPERIMENT_NAME": "tracking-test",
    }


def wandb_segments(run_dir: Path) -> list[dict]:
    """One dict per offline segment (each job of a resumed run writes one), oldest first:
    run_id, config, history items, merged summary, exit code; read by wandb's own reader."""
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        done = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        seg = {"run_id": None, "config": {}, "history": [], "summary": {}, "exit_code": None}
        for line in done.stdout.splitlines():
            rec = json.loads(line)
            kind = rec["type"]
            if kind == "run":
                seg["run_id"] = rec["run"]["run_id"]
            elif kind == "config":
                seg["config"].update(rec["config"]["update"])
            elif kind == "history":
                seg["history"].append(rec["history"]["item"])
            elif kind == "summary":
                seg["summary"].update(rec["summary"].get("update", {}))
            elif kind == "exit":
                seg["exit_code"] = rec["exit"].get("exit_code", 0)
        out.append(seg)
    return out


def wandb_steps(segments: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` as W&B keeps them for a run resumed over these segments: a row
    at or below the last step the run already holds is ignored (W&B's rule for ``log(step=)``)."""
    out: list[tuple[int, float]] = []
    for seg in segments:
        for h in seg["history"]:
            if key in h and (not out or h["_step"] > out[-1][0]):
                out.append((int(h["_step"]), h[key]))
    return out


def mlflow_run(tmp: Path):
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    exp = client.get_experiment_by_name("tracking-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one tracked run, however many jobs
    return client, runs[0]


def mlflow_steps(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def losses(run_dir: Path, split: str = "train") -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run_dir, split)]


def job_cmd(recipe: Path, *overrides: str) -> list[str]:
    return [sys.executable, INSTRUMENTED, "train", str(recipe), *overrides]  # LLMFT_FAULT_INJECT below


def job_env(tmp: Path, **extra: str) -> dict[str, str]:
    # WANDB_SERVICE: the W&B service of this pytest process (an in-process test started one);
    # a job must start its own, as on a cluster, or a killed job's stream outlives the job.
    drop = ("WANDB_DIR", "WANDB_SERVICE", "MLFLOW_ALLOW_FILE_STORE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", **tracker_env_vars(tmp), **extra}
