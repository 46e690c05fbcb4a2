"""Resuming: which checkpoint, whether this recipe may continue it, and its schedule.

A checkpoint written by this llmft holds the run's intent and its decisions apart:
``recipe.yaml`` is the recipe as given (``auto`` kept, environment values as typed) and
``plan.yaml`` the decisions taken for it (engine, world, batch: ``plan_summary``, what
``llmft compile`` writes). A resume compares intent with intent and plan with plan:

- intent: the model, adapter, data and seed must match (they decide the weights the state
  belongs to and the data order its sample count indexes); any other change is deliberate and
  logged (``optim.lr``, ``train.max_steps``, ... take effect from the resumed step on);
- plan: another world size re-solves accumulation (elastic resume), another global batch or
  engine is logged; none of them is refused.

A checkpoint written before ``plan.yaml`` existed holds the resolved recipe (decisions written
in): it is compared with this run's resolved recipe, and its plan is read from
``trainer_state.json`` (docs/checkpoints.md).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from llmft.checkpoint.layout import TrainerState, latest_checkpoint, resolve_checkpoint, saved_recipe, step_dirs
from llmft.checkpoint.verify import DamagedCheckpoint, check_checkpoint
from llmft.errors import Problem, UserError
from llmft.plan.batch import BatchPlan
from llmft.plan.layout import RunPlan
from llmft.plan.resolve import PLAN_FILE, plan_summary
from llmft.recipe.load import flatten, to_container, to_yaml, unresolve_env
from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

# Intent a checkpoint must share with the recipe that resumes it: they decide the weights the
# checkpoint's state belongs to and the data order its sample count indexes.
RESUME_MUST_MATCH = ("model", "peft", "data", "run.seed")
# ... except these, which change neither (a changed value is logged like any other change).
RESUME_MAY_CHANGE = (
    "model.gradient_checkpointing",
    "model.compile",
    "model.liger_kernels",
    "data.num_workers",
    "data.prefetch_factor",
    "data.eval",
    "data.cache_dir",
    "data.num_proc",
)
# How this invocation resumes, not what it trains: a change is expected and not worth a warning.
HOW_TO_RESUME = ("checkpoint.resume", "run.overwrite")


def intent_yaml(plan: RunPlan) -> str:
    """A checkpoint's ``recipe.yaml``: the recipe as given (environment values as typed)."""
    recipe = copy.deepcopy(plan.recipe)
    unresolve_env(recipe)
    return to_yaml(recipe)


def plan_yaml(plan: RunPlan) -> str:
    """A checkpoint's ``plan.yaml``: the decisions, as ``llmft compile`` writes them."""
    return yaml.safe_dump(plan_summary(plan), sort_keys=False, default_flow_style=False)


# --- which checkpoint ---------------------------------------------------------------------------


def resume_point(plan: RunPlan) -> Path | None:
    """The checkpoint this run resumes from (rank 0 decides). ``auto``: the newest complete one that
    is whole; a damaged one is skipped with a warning naming the file (and left in place: it is
    replaced when the run saves that step again). A path: that checkpoint, which must be whole.
    ``never``: none, and an earlier run's checkpoints are refused unless ``run.overwrite`` (then the
    caller, which owns the run directory, clears them: ``llmft.checkpoint.rundir.clear_for_fresh_start``)."""
    recipe = plan.recipe
    run_dir = Path(recipe.run.output_dir)
    resume = recipe.checkpoint.resume
    if resume == "auto":
        latest_checkpoint(run_dir)  # logs a stale or invalid checkpoints/latest
        for _, step_dir in reversed(step_dirs(run_dir)):
            try:
                check_checkpoint(step_dir, resume=True)
                return step_dir
            except DamagedCheckpoint as e:
                log.warning("not resuming from %s: %s; trying the checkpoint before it", step_dir.name, e)
        return None
    if resume != "never":
        step_dir = resolve_checkpoint(resume)
        check_checkpoint(step_dir, resume=True)  # asked for by name: a damaged one is an error, not a silent fallback
        return step_dir
    existing = step_dirs(run_dir)
    if existing and not recipe.run.overwrite:
        raise UserError(
            Problem(
                "checkpoint.resume",
                f"is never, but {run_dir} already holds {len(existing)} checkpoint(s) (newest step {existing[-1][0]})",
                "Use checkpoint.resume=auto to continue that run, a new run.output_dir, or run.overwrite=true "
                "to delete its checkpoints and metrics.",
            )
        )
    return None


# --- may this recipe continue it ----------------------------------------------------------------


@dataclass(frozen=True)
class SavedPlan:
    """The decisions a checkpoint was written under."""

    engine: str
    world_size: int
    batch: BatchPlan | None  # None: a hand-made trainer state without one


def saved_plan(ckpt: Path) -> SavedPlan:
    """From ``plan.yaml``, or from ``trainer_state.json`` in a checkpoint written before it existed."""
    path = Path(ckpt) / PLAN_FILE
    if not path.is_file():
        state = TrainerState.read(ckpt)
        return SavedPlan(state.engine, state.world_size, state.batch)
    try:
        data = yaml.safe_load(path.read_text())
        world = data["world"]
        return SavedPlan(data["engine"], world["nnodes"] * world["nproc_per_node"], BatchPlan.from_dict(data["batch"]))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise UserError(
            Problem(
                str(path),
                f"cannot be read as the plan llmft writes ({type(e).__name__}: {e})",
                "Resume from another checkpoint (checkpoint.resume=PATH), or restore the file.",
            )
        ) from None


def check_resume_compatible(ckpt: Path, plan: RunPlan) -> None:
    """Refuse a checkpoint trained on another model, adapter, data or seed; log deliberate changes."""
    ckpt = Path(ckpt)
    # Intent with intent; a checkpoint from before plan.yaml holds decisions in its recipe, so
    # it is compared with this run's recipe with the decisions written in (the same kind of file).
    ours = intent_yaml(plan) if (ckpt / PLAN_FILE).is_file() else to_yaml(plan.resolved_recipe())
    saved = flatten(saved_recipe(ckpt))  # an ${oc.env:VAR} unset now stays as its text
    now = _flat(OmegaConf.create(ours))
    defaults = flatten(to_container(Recipe()))
    diffs = {
        k: (saved.get(k), now.get(k))
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k) and not _added_since(k, saved, now, defaults)
    }
    fatal = {k: v for k, v in diffs.items() if k.startswith(RESUME_MUST_MATCH) and not k.startswith(RESUME_MAY_CHANGE)}
    if fatal:
        raise UserError(
            *[
                Problem(k, f"checkpoint has {a!r}, recipe has {b!r}", f"Set {k}={_override(a)} to resume it.")
                for k, (a, b) in fatal.items()
            ],
            title=f"cannot resume from {ckpt}: the model, adapter or data settings differ "
            "(set checkpoint.resume=never with a new run.output_dir to start fresh, or restore these values)",
        )
    for k, (a, b) in diffs.items():
        if not k.startswith(HOW_TO_RESUME):
            log.warning("resuming with a changed setting: %s %r -> %r", k, a, b)
    saved = saved_plan(ckpt)
    _check_generation_batch(ckpt, saved, plan)
    _log_plan_changes(saved, plan, set(diffs))


def _check_generation_batch(ckpt: Path, saved: SavedPlan, plan: RunPlan) -> None:
    """A checkpoint inside a generation batch (an objective whose steps repeat one global batch:
    GRPO's ``rl.iterations``) continues it only with the same batch: another global batch, repeat
    count or group size G would deal other items to the next step than the ones its kept state
    holds. On a generation boundary any of them may change."""
    spec = plan.objective_spec
    if spec.repeats is None or saved.batch is None:
        return
    recipe = saved_recipe(ckpt)

    def saved_value(key: str | None, now: int) -> Any:
        if key is None:
            return now
        section, _, name = key.partition(".")
        value = (recipe.get(section) or {}).get(name, _default(section, name))
        return value

    repeats = saved_value(spec.repeats, spec.repeat_count(plan.recipe))
    group = saved_value(spec.group, spec.group_size(plan.recipe))
    if not isinstance(repeats, int) or repeats <= 1:
        return
    state = TrainerState.read(ckpt)
    if state.samples % (saved.batch.global_batch_size * repeats) == 0:
        return
    then = (saved.batch.global_batch_size, repeats, group)
    now = (plan.batch.global_batch_size, spec.repeat_count(plan.recipe), spec.group_size(plan.recipe))
    if then == now:
        return
    keys = ("batch.global_batch_size", spec.repeats, spec.group or "G")
    raise UserError(
        Problem(
            str(ckpt),
            f"sits inside a generation batch (step {state.step}, {spec.repeats} {repeats}): its kept completions are "
            f"a global batch of {then[0]} completions with {spec.repeats} {then[1]} and G {then[2]}; this recipe has "
            f"{now[0]}, {now[1]} and {now[2]}",
            "Resume it with "
            + " ".join(f"{k}={v}" for k, v in zip(keys, then, strict=True) if spec.group or k != "G")
            + f", or from a checkpoint on a generation boundary (a step that is a multiple of {spec.repeats}).",
        )
    )


def _default(section: str, name: str) -> Any:
    return getattr(getattr(Recipe(), section, None), name, None)


def _added_since(key: str, saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any]) -> bool:
    """A key the checkpoint's recipe lacks, at its default now: a newer llmft added it (the run
    that wrote the checkpoint had its default behaviour), so it is no change."""
    return key not in saved and key in defaults and now.get(key) == defaults[key]


def _flat(node: Any) -> dict[str, Any]:
    return flatten(OmegaConf.to_container(node, resolve=True))


def _override(value: Any) -> str:
    """A value as a ``KEY=VALUE`` override spells it."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _log_plan_changes(saved: SavedPlan, plan: RunPlan, changed: set[str]) -> None:
    """Plan with plan: all allowed; a decision that changed without the recipe saying so is logged
    (``changed``: the recipe keys already logged as changed)."""
    b = plan.batch
    if saved.world_size != plan.world.size:
        engine = f" (engine {saved.engine} -> {plan.engine})" if saved.engine != plan.engine else ""
        log.warning(
            "elastic resume: checkpoint written by %d process(es), now %d; %s%s",
            saved.world_size,
            plan.world.size,
            b.equation(),
            engine,
        )
    elif saved.engine != plan.engine and "distributed.engine" not in changed:
        log.warning("resuming with another engine: checkpoint written by %s, now %s", saved.engine, plan.engine)
    if (
        saved.batch is not None
        and saved.batch.global_batch_size != b.global_batch_size
        and "batch.global_batch_size" not in changed
    ):
        log.warning(
            "resuming with another global batch: %d -> %d sequences per optimizer step (the sample position is kept)",
            saved.batch.global_batch_size,
            b.global_batch_size,
        )


# --- the schedule -------------------------------------------------------------------------------


def resume_schedule(scheduler, saved_state: dict[str, Any], peak_lr: float) -> None:
    """Continue the saved schedule position with this recipe's peak lr and length.

    Loading the optimizer and scheduler state brings back the lr of the run that wrote the
    checkpoint; re-deriving it from the current recipe makes a deliberate ``optim.lr`` or
    ``train.max_steps`` change take effect at once, and is an exact no-op when nothing changed
    (the same product ``base_lr * factor(step)`` the scheduler computes).
    """
    scheduler.load_state_dict(saved_state)
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [peak_lr] * len(groups)
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = peak_lr
        group["lr"] = peak_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports
