"""Trackers: where a run's numbers go besides ``metrics.jsonl`` (TensorBoard, W&B, MLflow).

Each tracker is a small object behind one Protocol (``Tracker``); ``Trackers`` fans rows out
to them on the main rank. What holds (docs/tracking.md says it for users):

- ``metrics.jsonl`` is written first and is the record; a tracker that fails to start or to
  send is a warning, never a lost training step (after ``MAX_FAILURES`` failures in a row it
  is dropped for the rest of the run).
- Resume continues the same tracked run: the tracker's run id is stored in each checkpoint
  (``trainer_state["trackers"]``) and passed back on resume, whatever the world size.
- Each (split, step) reaches a tracker exactly once. Steps that were logged after the last
  checkpoint and then re-run after a kill are *skipped*: the tracker keeps the first value,
  ``metrics.jsonl`` keeps both rows (the later counts). The high-water mark per tracker and
  split lives in ``<run_dir>/trackers.json`` (rewritten after every send) and in the
  checkpoint (as of the checkpoint), so a resume knows what each tracker already holds.

wandb and mlflow are imported only when a recipe asks for them (they take seconds to import).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from llmft.checkpoint.layout import TrainerState
from llmft.errors import Problem, UserError
from llmft.metrics.plot import read_metrics
from llmft.plan.memory import estimate_memory
from llmft.recipe.load import flatten, to_container

if TYPE_CHECKING:
    from llmft.job.dist import DistEnv
    from llmft.plan.layout import RunPlan
    from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

TRACKERS = ("tensorboard", "wandb", "mlflow")
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # tracker -> pip extra
LEDGER = "trackers.json"  # <run_dir>/trackers.json: run ids and the last step each tracker received
DEFAULT_PROJECT = "llmft"
MAX_FAILURES = 3
# A remote MLflow server that is down must not stall each step for minutes (its default retries
# back off up to ~2 min per call); these apply only where the user set nothing.
_MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_VERSIONED = ("llmft", "torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "wandb", "mlflow")


def selected(recipe: Recipe) -> list[str]:
    """The trackers a recipe asks for: ``run.trackers`` in order, without tensorboard when
    ``run.tensorboard`` is false (the older switch)."""
    names = list(dict.fromkeys(recipe.run.trackers or ()))
    if not recipe.run.tensorboard and "tensorboard" in names:
        names.remove("tensorboard")
    return names


def mlflow_uri(recipe: Recipe) -> str | None:
    return recipe.run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


def check_available(recipe: Recipe) -> None:
    """Every tracker the recipe names exists and its package is installed; call it right after
    the recipe is loaded, before any model is. Raises ``UserError`` naming the extra to install.

    tensorboard is the default and stays optional: without the package it is skipped (logged).
    """
    problems = []
    for name in recipe.run.trackers or ():
        if name not in TRACKERS:
            problems.append(
                Problem("run.trackers", f"{name!r} is not a tracker", f"Use any of: {', '.join(TRACKERS)}.")
            )
        elif name != "tensorboard" and find_spec(name) is None:
            problems.append(
                Problem(
                    "run.trackers",
                    f"lists {name}, but the {name} package is not installed",
                    f'Install the extra: pip install -e ".[{EXTRAS[name]}]" (or pip install "llmft[{EXTRAS[name]}]"), '
                    f"or remove {name} from run.trackers.",
                )
            )
    if "mlflow" in selected(recipe) and find_spec("mlflow") is not None:
        uri = mlflow_uri(recipe)
        if (uri is None or uri.split(":", 1)[0].split("+", 1)[0] in _DB_SCHEMES) and find_spec("sqlalchemy") is None:
            problems.append(
                Problem(
                    "run.mlflow_tracking_uri",
                    f"{'is not set, so MLflow uses its default sqlite:///mlflow.db' if uri is None else repr(uri)}, "
                    "a database store that needs the full mlflow package (the mlflow extra installs mlflow-skinny)",
                    "Point MLFLOW_TRACKING_URI (or run.mlflow_tracking_uri) at your MLflow server (http://...) or a "
                    "local file store (file:./mlruns), or pip install mlflow for a database store.",
                )
            )
    if problems:
        raise UserError(*problems, title=f"run.trackers: {len(problems)} problem(s)" if len(problems) > 1 else "")


# --- what a run logs as config / params ---------------------------------------------------------


def system_info() -> dict[str, Any]:
    """Versions, Python, platform and GPUs: where a number came from."""
    import importlib.metadata as md

    versions = {}
    for pkg in _VERSIONED:
        for dist in (pkg, f"{pkg}-skinny"):  # mlflow-skinny is mlflow without its server
            try:
                versions[pkg] = md.version(dist)
                break
            except md.PackageNotFoundError:
                pass
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = {
                "count": torch.cuda.device_count(),
                "name": torch.cuda.get_device_name(0),
                "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                "cuda": torch.version.cuda,
            }
        else:
            info["gpu"] = None
    return info


def run_info(run: RunPlan, env: DistEnv, steps: int) -> dict[str, Any]:
    """The resolved recipe, the batch equation, the plan (engine, world, memory estimate) and the
    system: W&B config and MLflow params of the run."""
    recipe, plan = run.resolved_recipe(), run.batch
    memory = None
    try:
        memory = round(estimate_memory(run).total / 2**30, 3)
    except Exception:  # an unknown architecture has no estimate; the run does not need one
        pass
    return {
        "recipe": to_container(recipe),
        "batch": {
            "equation": plan.equation(),
            **plan.to_dict(),
            "tokens_per_step": plan.global_batch_size * recipe.data.max_seq_len,
        },
        "plan": {
            "engine": run.engine,
            "world_size": env.world_size,
            "local_world_size": env.local_world_size,
            "launcher": env.launcher,
            "max_steps": steps,
            "memory_estimate_gib": memory,
        },
        "system": system_info(),
    }


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """``{split}/{key}: value`` for the finite numbers of a metrics row (step and split excluded)."""
    split = row.get("split", "train")
    out = {}
    for k, v in row.items():
        if k in ("split", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[f"{split}/{k}"] = float(v)
    return out


# --- the trackers -------------------------------------------------------------------------------


class Tracker(Protocol):
    name: str
    durable_on_send: bool  # a send is stored when log() returns (else only once close() returns)

    def identity(self) -> dict[str, Any]:
        """What a resumed job needs to continue this tracked run (JSON)."""
        ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def summary(self, values: dict[str, Any]) -> None: ...

    def close(self, stopped: bool) -> None: ...


class _Context:
    """What a tracker's start function gets."""

    def __init__(self, run_dir: Path, recipe: Recipe, info: dict[str, Any], saved: dict[str, Any] | None) -> None:
        self.run_dir = run_dir
        self.recipe = recipe
        self.info = info
        self.saved = saved  # this tracker's identity from the checkpoint; None: a new tracked run

    @property
    def run_name(self) -> str:
        return self.recipe.run.name or self.run_dir.resolve().name

    def project(self, env_var: str) -> str:
        return self.recipe.run.project or os.environ.get(env_var) or DEFAULT_PROJECT


class TensorBoardTracker:
    name = "tensorboard"
    durable_on_send = True  # flushed per row

    def __init__(self, ctx: _Context) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = ctx.run_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.log_dir))
        if ctx.saved is None:
            self.writer.add_text("config", "```\n" + json.dumps(ctx.info, indent=1, default=str) + "\n```", 0)

    def identity(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a killed run keeps what the ledger says was sent

    def summary(self, values: dict[str, Any]) -> None:
        self.writer.add_text("summary", json.dumps(values, default=str))

    def close(self, stopped: bool) -> None:
        self.writer.close()


class WandbTracker:
    """W&B, configured as W&B users do: WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR, ...

    Rows go to W&B's own step axis at their optimizer step (``log(..., step=N)``): a train and an
    eval row of one step share a history row, and W&B itself ignores a step at or below the last
    one a resumed run holds, so a step re-sent after a kill cannot appear twice on the server.
    """

    name = "wandb"
    durable_on_send = False  # its service process buffers; a killed job loses the buffer

    def __init__(self, ctx: _Context) -> None:
        import wandb

        saved = ctx.saved or {}
        self.run = wandb.init(
            project=saved.get("project") or ctx.project("WANDB_PROJECT"),
            entity=saved.get("entity") or os.environ.get("WANDB_ENTITY") or None,
            name=ctx.run_name,
            id=saved.get("run_id"),
            resume="allow" if saved else None,
            dir=None if os.environ.get("WANDB_DIR") else str(ctx.run_dir),
            reinit="create_new",
        )
        self.run.config.update(ctx.info, allow_val_change=True)

    def identity(self) -> dict[str, Any]:
        return {"run_id": self.run.id, "project": self.run.project, "entity": self.run.entity or None}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def close(self, stopped: bool) -> None:
        if stopped:
            self.run.mark_preempting()
        self.run.finish()


class MlflowTracker:
    """MLflow through its client API (no global active run), configured as MLflow users do:
    MLFLOW_TRACKING_URI (or ``run.mlflow_tracking_uri``), MLFLOW_EXPERIMENT_NAME (or ``run.project``).

    A local file store (``file:...`` or a path) is MLflow's "maintenance mode" backend in 3.x,
    refused unless MLFLOW_ALLOW_FILE_STORE is set: naming one is asking for it, so it is set
    (where the user did not set it) for this process.
    """

    name = "mlflow"
    durable_on_send = True  # log_batch returns once the store (file or server) has it

    def __init__(self, ctx: _Context) -> None:
        for k, v in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(k, v)
        uri = mlflow_uri(ctx.recipe)
        if _is_file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        saved = ctx.saved
        if saved:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._params_on_resume(ctx)
        else:
            name = ctx.project("MLFLOW_EXPERIMENT_NAME")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run = self.client.create_run(exp_id, run_name=ctx.run_name, tags={"llmft.run_dir": str(ctx.run_dir)})
            self.run_id = run.info.run_id
            self._log_params(flatten(ctx.info))

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def _params_on_resume(self, ctx: _Context) -> None:
        """MLflow params are write-once: new keys are logged, changed values (the world size,
        accumulation of an elastic resume) become tags ``resumed.<key>``."""
        have = self.client.get_run(self.run_id).data.params
        now = {k[:250]: str(v)[:6000] for k, v in flatten(ctx.info).items()}
        self._log_params({k: v for k, v in now.items() if k not in have})
        for k, v in now.items():
            if k in have and have[k] != v and not k.startswith("system."):
                self.client.set_tag(self.run_id, f"resumed.{k}", v)

    def identity(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def summary(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.client.set_tag(self.run_id, f"llmft.{k}", str(v))

    def close(self, stopped: bool) -> None:
        self.client.set_terminated(self.run_id, status="KILLED" if stopped else "FINISHED")


def _is_file_store(uri: str | None) -> bool:
    """``file:...`` or a plain path (MLflow's local file store)."""
    if not uri:
        return False
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    return scheme in ("", "file") or len(scheme) == 1  # len 1: a Windows drive letter


START: dict[str, Callable[[_Context], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


# --- the fan-out --------------------------------------------------------------------------------


def read_ledger(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(run_dir) / LEDGER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Trackers:
    """The trackers of one run on the main rank: start, send each row once, remember, close.

    ``resume``: ``trainer_state["trackers"]`` of the checkpoint this job resumes and
    ``resume_step`` its step (None: a fresh run). The shape of ``resume``, of ``state()`` and of
    ``<run_dir>/trackers.json``::

        {"wandb": {"run_id": "...", "project": "...", "entity": null,
                   "last_step": {"train": 6, "eval": 4}, "durable_step": {"train": 4, "eval": 4}},
         "mlflow": {"run_id": "...", "tracking_uri": "file:...", "last_step": {...}, "durable_step": {...}},
         "tensorboard": {"log_dir": ".../tensorboard", "last_step": {...}, "durable_step": {...}}}

    ``last_step``: the last step of each split handed to the tracker; ``durable_step``: the last
    one it is known to hold. They are equal for MLflow and TensorBoard (each send is written
    before it returns); W&B buffers in its service process and a killed job loses that buffer,
    so its ``durable_step`` advances only when a run is closed cleanly (finished, or stopped by a
    signal). On resume each tracker is sent again, from metrics.jsonl, the rows after its
    ``durable_step`` up to the checkpoint, then live rows after that; rows it holds are skipped.
    """

    def __init__(
        self,
        run_dir: Path,
        recipe: Recipe,
        info: dict[str, Any],
        resume: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.active: dict[str, Tracker] = {}
        self.sent: dict[str, dict[str, int]] = {}
        self.durable: dict[str, dict[str, int]] = {}
        self.failures: dict[str, int] = {}
        ledger = read_ledger(self.run_dir)
        for name in selected(recipe):
            if name == "tensorboard" and find_spec("tensorboard") is None:
                log.info("tensorboard is not installed: no TensorBoard events (pip install -e '.[tensorboard]')")
                continue
            saved = (resume or {}).get(name)
            identity = {k: v for k, v in saved.items() if k not in _MARKS} if saved else None
            try:
                tracker = START[name](_Context(self.run_dir, recipe, info, identity))
            except Exception as e:
                log.warning(
                    "tracker %s did not start (%s: %s); training goes on, metrics.jsonl has every row",
                    name,
                    type(e).__name__,
                    _short(e),
                )
                continue
            self.active[name] = tracker
            held = _held(identity, saved, ledger.get(name))
            self.sent[name], self.durable[name] = dict(held), dict(held)
            if identity:
                log.info("%s: continuing %s", name, ", ".join(f"{k} {v}" for k, v in tracker.identity().items()))
        self._write_ledger()
        if resume_step is not None and self.active:
            self._replay(resume_step)

    def _replay(self, resume_step: int) -> None:
        """Rows up to the checkpoint that a tracker may not hold (W&B after a kill), from metrics.jsonl."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        try:
            splits = read_metrics(path)
        except UserError as e:
            log.warning("could not replay %s to the trackers: %s", path, e)
            return
        rows = [r for rows in splits.values() for r in rows if r["step"] <= resume_step]
        for row in sorted(rows, key=lambda r: (r["step"], r.get("split") != "train")):
            self.log(row)

    def log(self, row: dict[str, Any]) -> None:
        split, step = str(row.get("split", "train")), int(row["step"])
        values = _numbers(row)
        sent = False
        for name, tracker in list(self.active.items()):
            if step <= self.sent[name].get(split, 0):
                continue  # it holds this step already (sent before a kill, re-run since): keep its first value
            if self._call(name, tracker.log, step, values):
                self.sent[name][split] = step
                if tracker.durable_on_send:
                    self.durable[name][split] = step
                sent = True
        if sent:
            self._write_ledger()

    def summary(self, values: dict[str, Any]) -> None:
        for name, tracker in list(self.active.items()):
            self._call(name, tracker.summary, values)

    def state(self) -> dict[str, Any]:
        """For ``trainer_state["trackers"]`` of a checkpoint."""
        return {
            name: {
                **tracker.identity(),
                "last_step": dict(self.sent[name]),
                "durable_step": dict(self.durable[name]),
            }
            for name, tracker in self.active.items()
        }

    def close(self, stopped: bool = False) -> None:
        for name, tracker in list(self.active.items()):
            if self._call(name, tracker.close, stopped):
                self.durable[name] = dict(self.sent[name])
        self._write_ledger()
        self.active.clear()

    def _call(self, name: str, fn: Callable, *args: Any) -> bool:
        try:
            fn(*args)
        except Exception as e:
            self.failures[name] = self.failures.get(name, 0) + 1
            dropped = self.failures[name] >= MAX_FAILURES
            log.warning(
                "tracker %s failed (%s: %s)%s; training goes on, metrics.jsonl has every row",
                name,
                type(e).__name__,
                _short(e),
                f": dropped after {MAX_FAILURES} failures in a row" if dropped else "",
            )
            if dropped:
                self.active.pop(name, None)
            return False
        self.failures[name] = 0
        return True

    def _write_ledger(self) -> None:
        if not self.active:
            return
        path = self.run_dir / LEDGER
        tmp = path.with_name(f".{LEDGER}.tmp")
        try:
            tmp.write_text(json.dumps(self.state(), indent=1))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write %s: %s", path, e)


_MARKS = ("last_step", "durable_step")


def _held(identity: dict | None, saved: dict | None, ledger: dict | None) -> dict[str, int]:
    """The last step per split a continued tracked run holds for sure: the ledger's
    ``durable_step`` when the ledger speaks of the same run (it is rewritten after every send),
    else what the checkpoint had sent (a checkpoint copied away from its run dir)."""
    if not identity:
        return {}
    if ledger and {k: ledger.get(k) for k in identity} == identity:
        return {k: int(v) for k, v in (ledger.get("durable_step") or {}).items()}
    return {k: int(v) for k, v in ((saved or {}).get("last_step") or {}).items()}


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


# --- after training: the export path on the tracked run -----------------------------------------


def record_export(step_dir: Path, out: Path) -> None:
    """Put the export path on the tracked run(s) named in the checkpoint (W&B summary, MLflow tag).

    A convenience: failures (no package, no network) are warnings.
    """
    try:
        state = TrainerState.read(Path(step_dir)).trackers or {}
    except UserError:  # not readable: nothing to record on
        return
    values = {"export_path": str(Path(out).resolve())}
    for name in ("wandb", "mlflow"):
        saved = state.get(name)
        if not saved or find_spec(name) is None:
            continue
        try:
            if name == "wandb":
                import wandb

                run = wandb.init(
                    id=saved["run_id"],
                    project=saved.get("project"),
                    entity=saved.get("entity"),
                    resume="allow",
                    dir=None if os.environ.get("WANDB_DIR") else str(Path(step_dir).parent.parent),
                    reinit="create_new",
                )
                run.summary.update({"llmft/export_path": values["export_path"]})
                run.finish()
            else:
                from mlflow import MlflowClient

                uri = saved.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
                if _is_file_store(uri):
                    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                MlflowClient(tracking_uri=uri).set_tag(saved["run_id"], "llmft.export_path", values["export_path"])
        except Exception as e:
            log.warning("could not record the export path on the %s run: %s", name, _short(e))
