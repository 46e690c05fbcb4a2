"""A training run: ``setup()`` -> ``restore(checkpoint)`` -> ``fit()`` -> ``finish()``.

``Run`` owns what one ``llmft train`` builds from a ``RunPlan``: the run directory, tokenizer,
data, engine (model + optimizer), schedule, checkpoints, metrics and eval. ``restore`` is the
one place that puts a checkpoint back, in the only order that is exact (docs/design.md):
trainer state -> sample position -> engine weights and optimizer -> schedule -> RNG, the RNG
last because creating the data iterator draws from it. ``fit`` runs the loop
(``llmft.loop``: one iteration = one optimizer step).

Tests instrument a run through ``RunHooks`` (``install_hooks``), never through the environment.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from llmft.checkpoint.layout import (
    BASE_DIR,
    CHECKPOINTS,
    RECIPE_FILE,
    TrainerState,
    latest_checkpoint,
    saved_optimizer,
    saved_recipe,
)
from llmft.checkpoint.manager import CheckpointManager, SaveHooks, set_rng_state
from llmft.dist import DistEnv
from llmft.errors import Problem, UserError
from llmft.loop import LoopConfig, LoopHooks, LoopState, train_loop
from llmft.metrics import Metrics
from llmft.plan.resolve import RunPlan, describe_engine
from llmft.recipe import to_yaml
from llmft.recipe.load import flatten
from llmft.stop import STOPPED_EXIT_CODE, StopRequest

log = logging.getLogger("llmft")

# Settings a checkpoint must share with the recipe that resumes it: they decide the weights the
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
# Changes that are expected on resume and not worth a warning: the world layout (the batch is
# re-solved for it) and how this invocation resumes.
RESUME_SILENT = (
    "distributed.",
    "batch.gradient_accumulation_steps",
    "batch.micro_batch_size",
    "checkpoint.resume",
    "run.overwrite",
)


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
        self.recipe_yaml = to_yaml(plan.resolved_recipe())
        self.state = LoopState()
        self.lock = None  # the run directory's lock (rank 0), from setup() until close()

    # --- setup ----------------------------------------------------------------------------------

    def setup(self) -> Path | None:
        """Build everything; return the checkpoint to resume from (None: a fresh start)."""
        from llmft.data import build_data
        from llmft.dist import barrier
        from llmft.engines import build_engine
        from llmft.evaluate import Evaluator
        from llmft.optim import build_scheduler
        from llmft.tokenizer import load_tokenizer

        recipe, plan, env = self.recipe, self.plan, self.env
        resume_from = self._claim_run_dir()
        if resume_from is not None:
            check_resume_compatible(resume_from, self.recipe_yaml)
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
        save_base_once(plan, self.engine, self.run_dir, env, resuming=resume_from is not None)
        self.scheduler = build_scheduler(self.engine.optimizer, recipe.optim, self.total_steps)
        self.checkpoints = CheckpointManager(
            self.run_dir, env, recipe.checkpoint.keep_last, SaveHooks(self.hooks.before_commit)
        )
        self.evaluator = Evaluator(recipe, env, self.engine, self.data, self.tokenizer, plan.batch)
        return resume_from

    def _claim_run_dir(self) -> Path | None:
        """Rank 0 takes the run directory (lock, ownership check, overwrite) and picks the checkpoint
        to resume from; every rank gets its decision, or its error."""
        from llmft.dist import broadcast_object
        from llmft.rundir import RunDirLock, check_ours, mark

        decision: Any = None
        error: UserError | None = None
        if self.env.is_main:
            try:
                check_ours(self.run_dir)
                self.lock = RunDirLock(self.run_dir).acquire()  # released when the process ends
                mark(self.run_dir)
                decision = resume_point(self.plan)
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
        from llmft.optim import build_optimizer

        return build_optimizer(model, self.recipe.optim, self.peak_lr)

    @property
    def peak_lr(self) -> float:
        from llmft.optim import scaled_lr

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
            self._log_resume(checkpoint, saved)
        self.metrics = self._metrics(saved)  # tracked runs (W&B, MLflow) continue where the checkpoint is
        # Creating the data iterator draws from the RNG: it happens before the RNG is restored.
        self.batches = iter(self._loader(first_step=self.state.step, position=self.state.samples))
        if checkpoint is not None:
            self.engine.load(checkpoint, load_optimizer=self._optimizer_state_fits(checkpoint))
            resume_schedule(self.scheduler, saved.scheduler, self.peak_lr)
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
        from llmft.tracking import run_info

        env = self.env
        return Metrics(
            self.run_dir,
            env.is_main,
            self.recipe,
            info=run_info(self.plan, env, self.total_steps) if env.is_main else None,
            resume={"trackers": saved.trackers, "step": saved.step} if saved is not None else None,
        )

    def _loader(self, *, first_step: int, position: int):
        from llmft.data import MicroBatchSampler, make_loader

        b, d = self.plan.batch, self.recipe.data
        order = self.data.order(self.recipe.run.seed, d.shuffle)  # a stream orders itself
        sampler = MicroBatchSampler(
            order,
            b.global_batch_size,
            b.micro_batch_size,
            b.gradient_accumulation_steps,
            self.env.rank,
            self.env.world_size,
            start_position=position,
        )
        sampler = self.hooks.wrap_sampler(sampler, first_step, self.env)
        workers = 0 if self.data.streaming else d.num_workers  # the stream's cursor lives here
        return make_loader(self.data.train, sampler, self.tokenizer.pad_token_id, workers, d.prefetch_factor)

    def _log_resume(self, checkpoint: Path, saved: TrainerState) -> None:
        log.info("resuming from %s (step %d, %d samples consumed)", checkpoint, saved.step, saved.samples)
        if saved.world_size != self.env.world_size:
            log.warning(
                "elastic resume: checkpoint written by %d process(es), now %d; global batch %d kept, %s",
                saved.world_size,
                self.env.world_size,
                self.plan.batch.global_batch_size,
                self.plan.batch.equation(),
            )

    # --- fit ------------------------------------------------------------------------------------

    def fit(self) -> LoopState:
        recipe = self.recipe
        if self.env.is_main:
            log.info("%s", banner(self.plan, self.env, self.total_steps, self.engine, self.data))
        if self.state.step >= self.total_steps:
            log.info("nothing to do: the checkpoint is at step %d of %d", self.state.step, self.total_steps)
            return self.state
        progress = _progress_bar(self.env, recipe, self.state, self.total_steps)
        hooks = LoopHooks(
            log_train=self.metrics.write,
            evaluate=self.evaluate,
            checkpoint=self.checkpoint,
            progress=progress.update if progress else (lambda s, r: None),
            extra_metrics=_extra_metrics(self.plan, self.env),
        )
        loop_cfg = LoopConfig(
            max_steps=self.total_steps,
            max_grad_norm=recipe.optim.max_grad_norm,
            log_every=recipe.train.log_every_steps,
            eval_every=recipe.train.eval_every_steps,
            checkpoint_every=recipe.checkpoint.every_steps,
        )
        try:
            args = (self.engine, self.scheduler, self.batches, self.plan.batch, self.env, loop_cfg)
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
        b = self.plan.batch
        state = TrainerState(
            step=st.step,
            samples=st.samples,
            tokens=st.tokens,
            epoch=self.data.epoch(st.samples),
            world_size=self.env.world_size,
            engine=self.plan.engine,
            batch={
                "global_batch_size": b.global_batch_size,
                "micro_batch_size": b.micro_batch_size,
                "gradient_accumulation_steps": b.gradient_accumulation_steps,
                "dp_size": b.dp_size,
            },
            scheduler=self.scheduler.state_dict(),
            versions=versions(),
            trackers=self.metrics.tracker_state(),  # run ids and the last step each tracker got
            data=self.data.state_at(st.samples),  # a stream's cursor (empty for cached data)
            data_sources=source_stats(self.data),
        )
        path = self.checkpoints.save(
            state,
            self.engine,
            recipe_yaml=self.recipe_yaml,
            tokenizer=self.tokenizer,
            save_optimizer=self.recipe.checkpoint.save_optimizer,
        )
        log.info("checkpoint: %s", path)

    # --- finish ---------------------------------------------------------------------------------

    def finish(self, state: LoopState) -> int:
        """Exit code: 0 when the run is done, ``STOPPED_EXIT_CODE`` after a stop request (requeue)."""
        if state.stopped:
            log.warning(
                "stopped by %s after step %d; checkpoint written. Run the same command to resume.",
                state.stopped,
                state.step,
            )
            self.metrics.close(stopped=True)
            return STOPPED_EXIT_CODE
        self.evaluate(state.step)
        if self.env.is_main:
            latest = latest_checkpoint(self.run_dir)
            self.metrics.summary({"checkpoint": str(latest), "export_command": f"llmft export {self.run_dir}"})
        self.metrics.close()
        if self.env.is_main:
            _report_done(self.run_dir)
        return 0

    def close(self) -> None:
        """Give the run directory back (a process that ends releases it anyway, kill -9 included)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# --- the pieces -------------------------------------------------------------------------------------


def total_steps(plan: RunPlan, num_samples: int) -> int:
    """train.epochs -> whole optimizer steps (rounded up: the last window is filled from the next epoch)."""
    t = plan.recipe.train
    if t.max_steps is not None:
        return t.max_steps
    return max(1, math.ceil(t.epochs * num_samples / plan.batch.global_batch_size))


def resume_point(plan: RunPlan) -> Path | None:
    """The checkpoint this run resumes from (rank 0 decides). ``auto``: the newest complete one that
    is whole; a damaged one is skipped with a warning naming the file (and left in place: it is
    replaced when the run saves that step again). A path: that checkpoint, which must be whole.
    ``never``: none, and an earlier run's checkpoints are refused unless ``run.overwrite``."""
    from llmft.checkpoint.layout import resolve_checkpoint, step_dirs
    from llmft.checkpoint.verify import DamagedCheckpoint, verify
    from llmft.rundir import clear_for_fresh_start

    recipe = plan.recipe
    run_dir = Path(recipe.run.output_dir)
    resume = recipe.checkpoint.resume
    if resume == "auto":
        latest_checkpoint(run_dir)  # logs a stale or invalid checkpoints/latest
        for _, step_dir in reversed(step_dirs(run_dir)):
            try:
                verify(step_dir)
                return step_dir
            except DamagedCheckpoint as e:
                log.warning("not resuming from %s: %s; trying the checkpoint before it", step_dir.name, e)
        return None
    if resume != "never":
        step_dir = resolve_checkpoint(resume)
        verify(step_dir)  # asked for by name: a damaged one is an error, not a silent fallback
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
    if recipe.run.overwrite:
        clear_for_fresh_start(run_dir)
    return None


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
    what = "rows after packing" if plan.recipe.data.packing else "training sequences"
    raise UserError(
        Problem(
            "batch.global_batch_size",
            f"is {g}, but the data has only {num_samples} {what}: one optimizer step would take some of them twice",
            f"Use a global batch of at most {num_samples} sequences, or more data.",
        )
    )


def check_resume_compatible(ckpt: Path, recipe_yaml: str) -> None:
    """Refuse a checkpoint trained on another model, adapter or data; log deliberate changes.

    A deliberate change (``optim.lr``, ``train.max_steps``, the schedule, ...) takes effect from
    the resumed step on; the world layout may change freely (elastic resume).
    """
    from omegaconf import OmegaConf

    saved = flatten(saved_recipe(ckpt))  # an ${oc.env:VAR} unset now stays as its text
    now = flatten(OmegaConf.to_container(OmegaConf.create(recipe_yaml), resolve=True))
    diffs = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
    fatal = {k: v for k, v in diffs.items() if k.startswith(RESUME_MUST_MATCH) and not k.startswith(RESUME_MAY_CHANGE)}
    if fatal:
        raise UserError(
            *[Problem(k, f"checkpoint has {a!r}, recipe has {b!r}") for k, (a, b) in fatal.items()],
            title=f"cannot resume from {ckpt}: the model, adapter or data settings differ "
            "(set checkpoint.resume=never with a new run.output_dir to start fresh, or restore these values)",
        )
    for k, (a, b) in diffs.items():
        if not k.startswith(RESUME_SILENT):
            log.warning("resuming with a changed setting: %s %r -> %r", k, a, b)


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


def save_base_once(plan: RunPlan, engine, run_dir: Path, env: DistEnv, *, resuming: bool) -> None:
    """``model.config`` + PEFT: write ``checkpoints/base_model`` once, from the model being trained.

    The random base exists nowhere else; with it saved, exporting an adapter does not depend on
    rebuilding it from ``run.seed`` with the same library versions. Only where rank 0 holds the
    whole model (single, DDP, DeepSpeed ZeRO 0-2): under FSDP2 and ZeRO-3 each rank holds shards,
    and gathering the base would put it whole on one rank, so export rebuilds it from
    ``model.config`` and ``run.seed`` (the engines build fresh models from that seed) and says so.
    """
    recipe = plan.recipe
    if not env.is_main or recipe.model.config is None or not plan.peft:
        return
    from torch.distributed.tensor import DTensor

    from llmft.export import save_base_model
    from llmft.model import compute_dtype

    target = run_dir / CHECKPOINTS / BASE_DIR
    if resuming and (target / "config.json").is_file():  # written by the run this one resumes
        return  # (a fresh start rewrites it: one left by an attempt without checkpoints may be stale)
    model = engine.unwrap()
    if any(isinstance(p, DTensor) or hasattr(p, "ds_numel") for p in model.parameters()):
        log.info("base model not saved (sharded by %s); export rebuilds it from model.config", engine.name)
        if not resuming:
            shutil.rmtree(target, ignore_errors=True)  # from an earlier attempt, maybe with another model
        return
    with torch.random.fork_rng(devices=[]):  # saving must not shift the run's random stream
        save_base_model(model, target, dtype=compute_dtype(recipe))


def banner(plan: RunPlan, env: DistEnv, steps: int, engine, data) -> str:
    from llmft.model import describe

    recipe, b = plan.recipe, plan.batch
    seq = recipe.data.max_seq_len
    lines = [
        f"batch: {b.equation()}",
        f"tokens per optimizer step: {'' if recipe.data.packing else 'up to '}{b.global_batch_size * seq:,} "
        f"({b.global_batch_size} sequences x {seq})",
        f"engine: {describe_engine(plan)}, {env.world_size} process(es), device {env.device.type}, "
        f"dtype {recipe.model.dtype}",
        f"parameters: {describe(engine.unwrap())}",
        f"data: {len(data.train):,} training {'rows' if recipe.data.packing else 'sequences'}, "
        f"{steps} optimizer steps ({steps * b.global_batch_size / max(len(data.train), 1):.2f} epochs)"
        if data.num_rows is not None  # a stream's length is unknown
        else f"data: streamed, {steps} optimizer steps ({steps * b.global_batch_size:,} rows)",
    ]
    return "\n".join(lines)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("llmft", "torch", "transformers", "peft", "deepspeed", "bitsandbytes"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _extra_metrics(plan: RunPlan, env: DistEnv) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """MFU and peak memory per train row (MFU only where the device's peak is known)."""
    from llmft.flops import flops_per_token, mfu, peak_flops
    from llmft.plan.shape import model_shape

    recipe = plan.recipe
    shape = model_shape(recipe.model)
    per_token = flops_per_token(shape, recipe.data.max_seq_len, peft=plan.peft) if shape else None
    peak = peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)

    def extra(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"mfu": mfu(row["tokens_per_s"], per_token, peak, env.world_size) if per_token else None}
        if torch.cuda.is_available():
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    return extra


def _report_done(run_dir: Path) -> None:
    plot = None
    try:
        from llmft.plot import plot_run

        plot = plot_run(run_dir)
    except Exception as e:  # the plot is a convenience; never fail a finished run over it
        log.warning("could not plot metrics: %s", e)
    log.info(
        "done.\n  model:      %s (export: llmft export %s)\n  metrics:    %s\n  plot:       %s",
        latest_checkpoint(run_dir),
        run_dir,
        run_dir / "metrics.jsonl",
        plot,
    )


def _progress_bar(env: DistEnv, recipe, state: LoopState, steps: int):
    if not (env.is_main and recipe.train.progress_bar):
        return None
    from tqdm import tqdm

    bar = tqdm(
        total=steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr, disable=None
    )

    class _Bar:
        def update(self, st: LoopState, row: dict[str, Any]) -> None:
            bar.set_postfix(
                loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False
            )
            bar.update(1)

        def close(self) -> None:
            bar.close()

    return _Bar()
