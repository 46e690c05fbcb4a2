"""``llmft train``: wire the recipe, world, data, engine, loop, metrics and checkpoints together.

Works as a plain process, under torchrun, the deepspeed launcher or srun: the
world comes from the environment and the batch equation is re-checked against it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmft.checkpoint import (
    CHECKPOINTS,
    CheckpointManager,
    latest_checkpoint,
    resolve_checkpoint,
    set_rng_state,
    step_dirs,
)
from llmft.dist import DistEnv, barrier, init_distributed, read_env, shutdown
from llmft.errors import Problem, UserError
from llmft.loop import LoopConfig, LoopHooks, LoopState, train_loop
from llmft.metrics import Metrics
from llmft.plan.batch import BatchPlan
from llmft.recipe import Recipe, load_recipe, to_yaml
from llmft.recipe.validate import batch_plan
from llmft.stop import STOPPED_EXIT_CODE, StopRequest
from llmft.tracking import check_available, run_info  # [tracking]

log = logging.getLogger("llmft")

# Settings a checkpoint must share with the recipe that resumes it: they decide the weights the
# checkpoint's state belongs to and the data order its sample count indexes.
RESUME_MUST_MATCH = ("model", "peft", "data", "run.seed")
# ... except these, which change neither (a changed value is logged like any other change).
RESUME_MAY_CHANGE = ("model.gradient_checkpointing", "data.num_workers", "data.prefetch_factor", "data.eval")
# Changes that are expected on resume and not worth a warning: the world layout (the batch is
# re-solved for it) and how this invocation resumes.
RESUME_SILENT = (
    "distributed.",
    "batch.gradient_accumulation_steps",
    "batch.micro_batch_size",
    "checkpoint.resume",
    "run.overwrite",
)
# Tests and debugging: a directory; each rank appends the dataset indices of every micro-batch it
# takes to rank-<R>.jsonl there, which proves a resume neither skips nor repeats a sample.
SAMPLE_LOG_ENV = "LLMFT_SAMPLE_LOG"


def setup_logging(env: DistEnv) -> None:
    level = logging.INFO if env.is_main else logging.WARNING
    fmt = "[llmft] %(message)s" if not env.distributed else f"[llmft rank {env.rank}] %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
    for noisy in ("transformers", "accelerate", "DeepSpeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def total_steps(recipe: Recipe, num_samples: int, plan: BatchPlan) -> int:
    """train.epochs -> whole optimizer steps (rounded up: the last window is filled from the next epoch)."""
    if recipe.train.max_steps is not None:
        return recipe.train.max_steps
    return max(1, math.ceil(recipe.train.epochs * num_samples / plan.global_batch_size))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def check_resume_compatible(ckpt: Path, recipe: Recipe) -> None:
    """Refuse a checkpoint trained on another model, adapter or data; log deliberate changes.

    A deliberate change (``optim.lr``, ``train.max_steps``, the schedule, ...) takes effect from
    the resumed step on; the world layout may change freely (elastic resume).
    """
    from omegaconf import OmegaConf

    saved = _flatten(OmegaConf.to_container(OmegaConf.load(ckpt / "recipe.yaml"), resolve=True))
    now = _flatten(OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True))
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


def save_base_once(recipe: Recipe, engine, run_dir: Path, env: DistEnv, *, resuming: bool) -> None:
    """``model.config`` + PEFT: write ``checkpoints/base_model`` once, from the model being trained.

    The random base exists nowhere else; with it saved, exporting an adapter does not depend on
    rebuilding it from ``run.seed`` with the same library versions. Only where rank 0 holds the
    whole model (single, DDP, DeepSpeed ZeRO 0-2): under FSDP2 and ZeRO-3 each rank holds shards,
    and gathering the base would put it whole on one rank, so export rebuilds it from
    ``model.config`` and ``run.seed`` (the engines build fresh models from that seed) and says so.
    """
    if not env.is_main or recipe.model.config is None or recipe.peft.method == "none":
        return
    from llmft.export import BASE_DIR, save_base_model

    target = run_dir / CHECKPOINTS / BASE_DIR
    if resuming and (target / "config.json").is_file():  # written by the run this one resumes
        return  # (a fresh start rewrites it: one left by an attempt without checkpoints may be stale)
    from torch.distributed.tensor import DTensor

    model = engine.unwrap()
    if any(isinstance(p, DTensor) or hasattr(p, "ds_numel") for p in model.parameters()):
        log.info("base model not saved (sharded by %s); export rebuilds it from model.config", engine.name)
        if not resuming:
            shutil.rmtree(target, ignore_errors=True)  # from an earlier attempt, maybe with another model
        return
    from llmft.engines.single import compute_dtype

    with torch.random.fork_rng(devices=[]):  # saving must not shift the run's random stream
        save_base_model(model, target, dtype=compute_dtype(recipe))


class _SampleLog:
    """A batch sampler that also appends each micro-batch's dataset indices to a file (``SAMPLE_LOG_ENV``)."""

    def __init__(self, sampler, directory: str, env: DistEnv, first_step: int) -> None:
        self.sampler = sampler
        self.path = Path(directory) / f"rank-{env.rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_size = env.world_size
        self.first_step = first_step

    def __iter__(self):
        accumulation = self.sampler.gradient_accumulation_steps
        for i, indices in enumerate(self.sampler):
            row = {
                "step": self.first_step + i // accumulation + 1,
                "micro_step": i % accumulation,
                "world_size": self.world_size,
                "indices": [int(j) for j in indices],
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            yield indices


def prepare_run_dir(recipe: Recipe, env: DistEnv) -> Path | None:
    """Decide what to resume from; never destroy an earlier run by accident."""
    run_dir = Path(recipe.run.output_dir)
    resume = recipe.checkpoint.resume
    if resume == "auto":
        return latest_checkpoint(run_dir)
    if resume != "never":
        return resolve_checkpoint(resume)
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
    if existing and env.is_main:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    return None


def train(recipe_path: str, overrides: list[str]) -> int:
    env = read_env()
    setup_logging(env)
    recipe = load_recipe(recipe_path, overrides, world_size=env.world_size)
    check_available(recipe)  # [tracking] a missing wandb/mlflow extra fails before any model loads
    init_distributed(
        env,
        recipe.distributed.backend,
        recipe.distributed.timeout_minutes,
        force=recipe.distributed.engine in ("fsdp", "deepspeed"),
    )
    # Installed before anything slow: a stop request during model loading is honoured after the
    # first step (checkpoint, exit 75) instead of killing the process with nothing to requeue.
    stop = StopRequest(recipe.distributed.stop_signal).install()
    try:
        return _train(recipe, env, stop)
    finally:
        stop.uninstall()
        shutdown()


def _banner(recipe: Recipe, plan: BatchPlan, env: DistEnv, steps: int, engine, data) -> str:
    from llmft.model import describe

    seq = recipe.data.max_seq_len
    lines = [
        f"batch: {plan.equation()}",
        f"tokens per optimizer step: {'' if recipe.data.packing else 'up to '}{plan.global_batch_size * seq:,} "
        f"({plan.global_batch_size} sequences x {seq})",
        f"engine: {recipe.distributed.engine}"
        + (f" (ZeRO-{recipe.distributed.zero_stage})" if recipe.distributed.engine == "deepspeed" else "")
        + f", {env.world_size} process(es), device {env.device.type}, dtype {recipe.model.dtype}",
        f"parameters: {describe(engine.unwrap())}",
        f"data: {len(data.train):,} training {'rows' if recipe.data.packing else 'sequences'}, "
        f"{steps} optimizer steps ({steps * plan.global_batch_size / max(len(data.train), 1):.2f} epochs)",
    ]
    return "\n".join(lines)


def _train(recipe: Recipe, env: DistEnv, stop: StopRequest) -> int:
    from llmft.data import GlobalOrder, MicroBatchSampler, build_data, make_loader
    from llmft.engines import build_engine
    from llmft.evaluate import Evaluator
    from llmft.optim import build_scheduler, scaled_lr
    from llmft.tokenizer import load_tokenizer

    run_dir = Path(recipe.run.output_dir)
    resume_from = prepare_run_dir(recipe, env)
    if resume_from is not None:
        check_resume_compatible(resume_from, recipe)
    barrier()
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(to_yaml(recipe))

    seed_everything(recipe.run.seed)
    plan = batch_plan(recipe, env.world_size)
    tokenizer = load_tokenizer(recipe.model)
    data = build_data(recipe, tokenizer)
    steps = total_steps(recipe, len(data.train), plan)
    if recipe.optim.lr_scaling != "none":
        log.info(
            "lr scaling %s: %.3g -> %.3g for global batch %d",
            recipe.optim.lr_scaling,
            recipe.optim.lr,
            scaled_lr(recipe.optim, plan.global_batch_size),
            plan.global_batch_size,
        )

    engine = build_engine(recipe, env, plan, tokenizer, steps)
    save_base_once(recipe, engine, run_dir, env, resuming=resume_from is not None)
    scheduler = build_scheduler(engine.optimizer, recipe.optim, steps)
    ckpt = CheckpointManager(run_dir, env, recipe.checkpoint.keep_last)
    state = LoopState()
    saved: dict[str, Any] | None = None
    if resume_from is not None:
        saved = ckpt.load_state(resume_from)
        state = LoopState(step=saved["step"], samples=saved["samples"], tokens=saved["tokens"])
        ckpt.protected = resume_from
        log.info("resuming from %s (step %d, %d samples consumed)", resume_from, state.step, state.samples)
        if saved["world_size"] != env.world_size:
            log.warning(
                "elastic resume: checkpoint written by %d process(es), now %d; global batch %d kept, %s",
                saved["world_size"],
                env.world_size,
                plan.global_batch_size,
                plan.equation(),
            )

    order = GlobalOrder(len(data.train), recipe.run.seed, recipe.data.shuffle)
    sampler = MicroBatchSampler(
        order,
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
        env.rank,
        env.world_size,
        start_position=state.samples,
    )
    if os.environ.get(SAMPLE_LOG_ENV):
        sampler = _SampleLog(sampler, os.environ[SAMPLE_LOG_ENV], env, state.step)
    loader = make_loader(
        data.train, sampler, tokenizer.pad_token_id, recipe.data.num_workers, recipe.data.prefetch_factor
    )
    batches = iter(loader)  # creating the iterator draws from the RNG: do it before restoring RNG state

    if resume_from is not None:
        engine.load(resume_from, load_optimizer=recipe.checkpoint.save_optimizer)
        resume_schedule(scheduler, saved["scheduler"], scaled_lr(recipe.optim, plan.global_batch_size))
        if saved.get("_rng") is not None:
            set_rng_state(saved["_rng"])

    if env.is_main:
        log.info("%s", _banner(recipe, plan, env, steps, engine, data))
    metrics = Metrics(  # [tracking] the same tracked runs continue on resume
        run_dir,
        env.is_main,
        recipe,
        info=run_info(recipe, plan, env, steps) if env.is_main else None,
        resume=saved,
    )
    evaluator = Evaluator(recipe, env, engine, data, tokenizer, plan)
    recipe_yaml = to_yaml(recipe)

    def evaluate(step: int) -> None:
        row = evaluator.run(step)
        if row is not None:
            metrics.write(row)
            log.info(
                "eval step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float))
            )

    def checkpoint(st: LoopState) -> None:
        trainer_state = {
            "step": st.step,
            "samples": st.samples,
            "tokens": st.tokens,
            "epoch": st.samples / len(data.train),
            "world_size": env.world_size,
            "engine": recipe.distributed.engine,
            "batch": {
                "global_batch_size": plan.global_batch_size,
                "micro_batch_size": plan.micro_batch_size,
                "gradient_accumulation_steps": plan.gradient_accumulation_steps,
                "dp_size": plan.dp_size,
            },
            "scheduler": scheduler.state_dict(),
            "versions": _versions(),
            "trackers": metrics.tracker_state(),  # [tracking] run ids + last step sent per tracker
        }
        path = ckpt.save(
            st.step,
            engine,
            trainer_state,
            recipe_yaml=recipe_yaml,
            tokenizer=tokenizer,
            save_optimizer=recipe.checkpoint.save_optimizer,
        )
        log.info("checkpoint: %s", path)

    progress = _progress_bar(env, recipe, state, steps)
    hooks = LoopHooks(
        log_train=metrics.write,
        evaluate=evaluate,
        checkpoint=checkpoint,
        progress=progress.update if progress else (lambda s, r: None),
        extra_metrics=_extra_metrics(recipe, engine, env),
    )
    loop_cfg = LoopConfig(
        max_steps=steps,
        max_grad_norm=recipe.optim.max_grad_norm,
        log_every=recipe.train.log_every_steps,
        eval_every=recipe.train.eval_every_steps,
        checkpoint_every=recipe.checkpoint.every_steps,
    )
    try:
        if state.step >= steps:
            log.info("nothing to do: the checkpoint is at step %d of %d", state.step, steps)
        else:
            state = train_loop(engine, scheduler, batches, plan, env, loop_cfg, state, hooks, stop)
    finally:
        if progress:
            progress.close()
    if state.stopped:
        log.warning(
            "stopped by %s after step %d; checkpoint written. Run the same command to resume.",
            state.stopped,
            state.step,
        )
        metrics.close(stopped=True)  # [tracking]
        return STOPPED_EXIT_CODE
    evaluate(state.step)
    if env.is_main:  # [tracking]
        metrics.summary({"checkpoint": str(latest_checkpoint(run_dir)), "export_command": f"llmft export {run_dir}"})
    metrics.close()
    if env.is_main:
        _finish(run_dir)
    return 0


def _finish(run_dir: Path) -> None:
    plot = None
    try:
        from llmft.plot import plot_run

        plot = plot_run(run_dir)
    except Exception as e:  # the plot is a convenience; never fail a finished run over it
        log.warning("could not plot metrics: %s", e)
    latest = latest_checkpoint(run_dir)
    log.info(
        "done.\n  model:      %s (export: llmft export %s)\n  metrics:    %s\n  plot:       %s",
        latest,
        run_dir,
        run_dir / "metrics.jsonl",
        plot,
    )


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("llmft", "torch", "transformers", "peft", "deepspeed", "bitsandbytes"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _extra_metrics(recipe: Recipe, engine, env: DistEnv):
    """MFU and peak memory per train row (MFU only where the device's peak is known)."""
    try:
        from llmft.flops import flops_per_token, peak_flops
        from llmft.plan.shape import model_shape
    except ImportError:
        return lambda row: {}
    shape = model_shape(recipe.model)
    per_token = flops_per_token(shape, recipe.data.max_seq_len, peft=recipe.peft.method != "none") if shape else None
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    peak = peak_flops(name, None)

    def extra(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"mfu": None}
        if per_token and peak:
            out["mfu"] = row["tokens_per_s"] * per_token / (peak * env.world_size)
        if torch.cuda.is_available():
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    return extra


def _progress_bar(env: DistEnv, recipe: Recipe, state: LoopState, steps: int):
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
