"""A training run: ``setup()`` -> ``restore(checkpoint)`` -> ``fit()`` -> ``finish()``.

``Run`` owns what one ``llmft train`` builds from a ``RunPlan``: the run directory, tokenizer,
data, engine (model + optimizer), schedule, checkpoints, metrics and eval. ``restore`` is the
one place that puts a checkpoint back, in the only order that is exact (docs/design.md):
trainer state -> sample position -> engine weights and optimizer -> schedule -> RNG, the RNG
last because creating the data iterator draws from it. ``fit`` runs the loop
(``llmft.training.loop``: one iteration = one optimizer step).

``Run`` is wiring: which checkpoint to resume and whether this recipe may continue it are
``llmft.checkpoint.resume``, the base model of a PEFT run ``llmft.model.base_model``, what
the run tells its user (banner, progress bar, MFU, final report) ``llmft.training.report``.

Tests instrument a run through ``RunHooks`` (``install_hooks``), never through the environment.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from llmft.checkpoint.layout import TrainerState, latest_checkpoint, saved_optimizer
from llmft.checkpoint.manager import CheckpointManager, SaveHooks, set_rng_state
from llmft.checkpoint.resume import check_resume_compatible, intent_yaml, plan_yaml, resume_point, resume_schedule
from llmft.checkpoint.rundir import RunDirLock, check_ours, clear_for_fresh_start, mark
from llmft.data import MicroBatchSampler, build_data, make_loader
from llmft.data.sampler import RepeatedSteps
from llmft.data.sequence import rank_slice
from llmft.data.tokenizer import load_tokenizer
from llmft.engines import Engine, build_engine
from llmft.errors import Problem, UserError
from llmft.job.dist import DistEnv, barrier, broadcast_object
from llmft.job.malloc import settle_for_steps
from llmft.metrics.record import Metrics
from llmft.metrics.trackers import run_info
from llmft.model.base_model import save_base_once
from llmft.objectives import ObjectiveSetup, build_objective
from llmft.plan.layout import RunPlan
from llmft.plan.memory import step_mmap_threshold
from llmft.recipe import to_yaml
from llmft.recipe.load import RECIPE_FILE
from llmft.stop import STOPPED_EXIT_CODE, StopRequest
from llmft.training.evaluate import Evaluator
from llmft.training.loop import LoopConfig, LoopHooks, LoopState, train_loop
from llmft.training.optim import build_optimizer, build_scheduler, scaled_lr
from llmft.training.report import ProgressBar, banner, extra_metrics, report_done, versions

log = logging.getLogger("llmft")


@dataclass
class RunHooks:
    """Instrumentation that tests install (``tests/instrumented.py``); no-ops in a normal run.

    ``wrap_sampler(sampler, first_step, env)`` may wrap the micro-batch sampler (to record which
    samples each rank takes); ``before_commit(step, rank)`` runs when a rank has written its part
    of a checkpoint, before the checkpoint is committed (to kill a process mid-save).
    """

    wrap_sampler: Callable[[Iterable[list[int]], int, DistEnv], Iterable[list[int]]] = lambda s, step, env: s
    before_commit: Callable[[int, int], None] = lambda step, rank: None


_installed = RunHooks()


def install_hooks(hooks: RunHooks) -> None:
    """Instrument every ``Run`` created from now on in this process."""
    global _installed
    _installed = hooks


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Run:
    def __init__(self, plan: RunPlan, env: DistEnv, stop: StopRequest, hooks: RunHooks | None = None) -> None:
        self.plan, self.env, self.stop = plan, env, stop
        self.recipe = plan.recipe
        self.hooks = hooks or _installed
        self.run_dir = Path(self.recipe.run.output_dir)
        self.recipe_yaml = to_yaml(plan.resolved_recipe())  # the run dir's: decisions written in (docs/checkpoints.md)
        self.intent_yaml, self.plan_yaml = intent_yaml(plan), plan_yaml(plan)  # each checkpoint's, apart
        self.state = LoopState()
        self.engine: Engine  # built in setup()
        self.lock = None  # the run directory's lock (rank 0), from setup() until close()

    # --- setup ----------------------------------------------------------------------------------

    def setup(self) -> Path | None:
        """Build everything; return the checkpoint to resume from (None: a fresh start)."""
        recipe, plan, env = self.recipe, self.plan, self.env
        resume_from = self._claim_run_dir()
        if resume_from is not None:
            check_resume_compatible(resume_from, plan)
        barrier()
        if env.is_main:
            (self.run_dir / RECIPE_FILE).write_text(self.recipe_yaml)

        seed_everything(recipe.run.seed)
        self.tokenizer = load_tokenizer(recipe.model)
        self.data = build_data(recipe, self.tokenizer, env)
        num_rows = self.data.num_rows  # None for a stream (build_data requires train.max_steps)
        if num_rows is not None:
            check_enough_data(num_rows, plan)
        self.total_steps = total_steps(plan, num_rows or 0)
        self.engine = build_engine(plan, env, self.tokenizer, self._make_optimizer)
        # What a micro-batch's loss is; it asks the engine for the frozen models it needs, and its
        # set-up runs before restore() loads a checkpoint (a frozen copy is the initial weights).
        self.objective = build_objective(plan, self.engine)
        self.objective.setup(ObjectiveSetup(self.data, env, self.tokenizer))
        save_base_once(plan, self.engine, self.run_dir, env, resuming=resume_from is not None)
        self.scheduler = build_scheduler(self.engine.optimizer, recipe.optim, self.total_steps)
        self.checkpoints = CheckpointManager(
            self.run_dir, env, recipe.checkpoint.keep_last, SaveHooks(self.hooks.before_commit)
        )
        self.evaluator = Evaluator(plan, env, self.engine, self.data, self.tokenizer, self.objective)
        return resume_from

    def _claim_run_dir(self) -> Path | None:
        """Rank 0 takes the run directory (lock, ownership check, overwrite) and picks the checkpoint
        to resume from; every rank gets its decision, or its error."""
        decision: Any = None
        error: UserError | None = None
        if self.env.is_main:
            try:
                overwrite = self.recipe.run.overwrite
                taken_over = check_ours(self.run_dir, overwrite)  # True: a folder of the user's, handed over
                self.lock = RunDirLock(self.run_dir).acquire()  # released when the process ends
                mark(self.run_dir)
                decision = resume_point(self.plan)
                # resume_point allowed it (a folder taken over holds no checkpoint it could resume):
                if overwrite and (taken_over or (decision is None and self.recipe.checkpoint.resume == "never")):
                    clear_for_fresh_start(self.run_dir)  # llmft's own entries only, each logged
            except UserError as e:
                error = e
                decision = ("refused", e.problems, e.title, e.exit_code)
        decision = broadcast_object(decision)
        if error is not None:
            raise error
        if isinstance(decision, tuple):  # rank 0 refused: every rank stops with its message
            refused = UserError(*decision[1], title=decision[2])
            refused.exit_code = decision[3]
            raise refused
        return decision

    def _make_optimizer(self, model: torch.nn.Module):
        """The one optimizer of the run, over the model as the engine prepared it."""
        return build_optimizer(model, self.recipe.optim, self.peak_lr)

    @property
    def peak_lr(self) -> float:
        return scaled_lr(self.recipe.optim, self.plan.batch.global_batch_size)

    # --- restore --------------------------------------------------------------------------------

    def restore(self, checkpoint: Path | None) -> None:
        """Put ``checkpoint`` back (or start fresh), in the one order that is exact."""
        saved = None
        if checkpoint is not None:
            saved = TrainerState.read(checkpoint)
            self.state = LoopState(step=saved.step, samples=saved.samples, tokens=saved.tokens)
            self.data.restore(saved.data)  # a stream's cursor (nothing for cached data)
            self.checkpoints.protected = checkpoint
            log.info("resuming from %s (step %d, %d samples consumed)", checkpoint, saved.step, saved.samples)
        self.metrics = self._metrics(saved)  # tracked runs (W&B, MLflow) continue where the checkpoint is
        # Creating the data iterator draws from the RNG: it happens before the RNG is restored.
        self.batches = self._batches(first_step=self.state.step, position=self.state.samples)
        if checkpoint is not None:
            self.engine.load(checkpoint, load_optimizer=self._optimizer_state_fits(checkpoint))
            resume_schedule(self.scheduler, saved.scheduler, self.peak_lr)
            self.objective.load_state_dict(self.checkpoints.load_objective_states(checkpoint))
            rng = self.checkpoints.load_rng(checkpoint)
            if rng is not None:  # None: this rank did not exist when the checkpoint was written
                set_rng_state(rng)

    def _optimizer_state_fits(self, checkpoint: Path) -> bool:
        """Load the checkpoint's optimizer state unless ``optim.name`` changed: AdamW's moments mean
        nothing to SGD (and loading them failed with ``KeyError: 'betas'``), so a deliberate switch
        starts the new optimizer fresh at the resumed step, and says so."""
        saved, now = saved_optimizer(checkpoint), self.recipe.optim.name
        if saved is None or saved == now or not self.recipe.checkpoint.save_optimizer:
            return self.recipe.checkpoint.save_optimizer
        log.warning(
            "optim.name changed %s -> %s: the checkpoint's %s state is not loaded; %s starts with fresh state at "
            "step %d (weights, schedule position, data position and RNG are restored)",
            saved,
            now,
            saved,
            now,
            self.state.step,
        )
        return False

    def _metrics(self, saved: TrainerState | None) -> Metrics:
        env = self.env
        return Metrics(
            self.run_dir,
            env.is_main,
            self.recipe,
            info=run_info(self.plan, env, self.total_steps) if env.is_main else None,
            resume={"trackers": saved.trackers, "step": saved.step} if saved is not None else None,
        )

    def _batches(self, *, first_step: int, position: int) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches: with sequence parallelism, its slice of its group's
        (every rank of a group draws the same ones: ``llmft.data.sequence``)."""
        batches = iter(self._loader(first_step=first_step, position=position))
        return (rank_slice(mb, self.plan.layout, self.env.rank) for mb in batches)

    def _loader(self, *, first_step: int, position: int):
        b, d = self.plan.batch, self.recipe.data
        order = self.data.order(self.recipe.run.seed, d.shuffle)  # a stream orders itself
        times = self.plan.objective_spec.repeat_count(self.recipe)
        if times > 1:  # each global batch taken k steps in a row (online RL's rl.iterations)
            order = RepeatedSteps(order, b.global_batch_size, times)
        # The sampler deals the global batch to data-parallel ranks: a sequence group is one.
        sampler = MicroBatchSampler(order, b, self.plan.layout.dp_rank(self.env.rank), start_position=position)
        sampler = self.hooks.wrap_sampler(sampler, first_step, self.env)
        workers = 0 if self.data.streaming else d.num_workers  # the stream's cursor lives here
        return make_loader(
            self.data.train, sampler, self.tokenizer.pad_token_id, workers, d.prefetch_factor, kind=self.data.kind
        )

    # --- fit ------------------------------------------------------------------------------------

    def fit(self) -> LoopState:
        recipe = self.recipe
        if self.env.is_main:
            log.info("%s", banner(self.plan, self.env, self.total_steps, self.engine, self.data))
        if self.state.step >= self.total_steps:
            log.info("nothing to do: the checkpoint is at step %d of %d", self.state.step, self.total_steps)
            return self.state
        show = self.env.is_main and recipe.train.progress_bar
        progress = ProgressBar(self.total_steps, self.state.step) if show else None
        hooks = LoopHooks(
            log_train=self.metrics.write,
            evaluate=self.evaluate,
            checkpoint=self.checkpoint,
            progress=progress.update if progress else (lambda s, r: None),
            extra_metrics=extra_metrics(self.plan, self.env),
        )
        loop_cfg = LoopConfig(
            max_steps=self.total_steps,
            log_every=recipe.train.log_every_steps,
            eval_every=recipe.train.eval_every_steps,
            checkpoint_every=recipe.checkpoint.every_steps,
        )
        settle_for_steps(step_mmap_threshold(self.plan))  # loading is done: the steps' threshold (llmft/job/malloc.py)
        try:
            args = (self.engine, self.objective, self.scheduler, self.batches, self.plan.batch, self.env, loop_cfg)
            self.state = train_loop(*args, self.state, hooks, self.stop)
        finally:
            if progress:
                progress.close()
        return self.state

    def evaluate(self, step: int) -> None:
        row = self.evaluator.run(step)
        if row is not None:
            self.metrics.write(row)
            log.info(
                "eval step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float))
            )

    def checkpoint(self, st: LoopState) -> None:
        state = TrainerState(
            step=st.step,
            samples=st.samples,
            tokens=st.tokens,
            epoch=self.data.epoch(st.samples),
            world_size=self.env.world_size,
            engine=self.plan.engine,
            batch=self.plan.batch,
            scheduler=self.scheduler.state_dict(),
            versions=versions(),
            trackers=self.metrics.tracker_state(),  # run ids and the last step each tracker got
            data=self.data.state_at(st.samples),  # a stream's cursor (empty for cached data)
            data_sources=source_stats(self.data),
        )
        path = self.checkpoints.save(
            state,
            self.engine,
            recipe_yaml=self.intent_yaml,
            plan_yaml=self.plan_yaml,
            tokenizer=self.tokenizer,
            save_optimizer=self.recipe.checkpoint.save_optimizer,
            objective_state=self.objective.state_dict(),
        )
        log.info("checkpoint: %s", path)

    # --- finish ---------------------------------------------------------------------------------

    def finish(self, state: LoopState) -> int:
        """Exit code: 0 when the run is done, ``STOPPED_EXIT_CODE`` after a stop request (requeue)."""
        if state.stopped:
            log.warning(
                "stopped by %s after step %d; %s. Run the same command to resume.",
                state.stopped,
                state.step,
                "checkpoint written" if state.step > 0 else "nothing was trained yet",  # a first step abandoned
            )
            self.metrics.close(stopped=True)
            return STOPPED_EXIT_CODE
        self.evaluate(state.step)
        if self.env.is_main:
            latest = latest_checkpoint(self.run_dir)
            self.metrics.summary({"checkpoint": str(latest), "export_command": f"llmft export {self.run_dir}"})
        self.metrics.close()
        if self.env.is_main:
            report_done(self.run_dir)
        return 0

    def close(self) -> None:
        """Stop what the objective started (a generation engine) and give the run directory back (a
        process that ends releases it anyway, kill -9 included)."""
        objective = getattr(self, "objective", None)
        if objective is not None:
            self.objective = None
            objective.close()
        evaluator = getattr(self, "evaluator", None)
        if evaluator is not None:  # its vLLM engine, if the eval made one
            evaluator.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# --- the pieces -------------------------------------------------------------------------------------


def total_steps(plan: RunPlan, num_samples: int) -> int:
    """train.epochs -> whole optimizer steps (rounded up: the last window is filled from the next epoch)."""
    t = plan.recipe.train
    if t.max_steps is not None:
        return t.max_steps
    times = plan.objective_spec.repeat_count(plan.recipe)  # steps that take one global batch
    return max(1, math.ceil(t.epochs * num_samples * times / plan.batch.global_batch_size))


def source_stats(data) -> list[dict[str, Any]]:
    """What each training source holds, for the checkpoint (and the model card an export writes)."""
    keys = ("records", "examples", "tokens", "target_tokens", "rows", "truncated", "skipped")
    return [
        {"source": e["source"], **{k: e["stats"][k] for k in keys if k in e["stats"]}}
        for e in data.entries
        if e["key"].startswith("data.train")
    ]


def check_enough_data(num_samples: int, plan: RunPlan) -> None:
    """One optimizer step takes ``global_batch_size`` distinct samples; fewer would repeat samples
    inside one step (the big batch would not be a batch of the data)."""
    g = plan.batch.global_batch_size
    if num_samples >= g:
        return
    spec = plan.objective_spec
    what, unit = spec.describe_items(plan.recipe), spec.unit  # "preference pairs", "rows after packing"
    raise UserError(
        Problem(
            "batch.global_batch_size",
            f"is {g}, but the data has only {num_samples} {what}: one optimizer step would take some of them twice",
            f"Use a global batch of at most {num_samples} {unit}, or more data.",
        )
    )
