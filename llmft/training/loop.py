"""The training loop. One iteration = one optimizer step = ``accumulation`` micro-batches.

The loss of a micro-batch is the sum of its per-item losses (token losses for SFT, pair losses
for preference objectives) divided by the count of items in the WHOLE global batch (counted for
the step before any backward and all-reduced once), so the summed gradients of any split
(micro x accumulation x ranks) equal the gradient of one big batch. What an item is and what its
loss is belong to the objective (``llmft.objectives``); the loop never branches on it.
Terms a model component attaches inside the policy (``llmft.model.aux_loss``: a router's
balancing loss) are added to each micro loss before its backward, each a sum over the micro-batch
over a global count known before the first backward, and logged as ``aux/<name>``; with none
attached the loop runs exactly as without them.

A stop request (``llmft.stop``) is voted on with the step's loss: every rank finishes that step,
checkpoints and stops. One that arrives while a step's completions are generated or scored
(online RL) abandons that step on every rank (``stop.Abandoned``, before any of it is applied):
the loop checkpoints the state before it, with the random state the step began with, and stops.
One that arrives during an eval cuts the eval short; one during a checkpoint lets it finish; after
either, one more vote, and the run stops right there instead of after another step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from llmft import stop as stops
from llmft.checkpoint.manager import rng_state, set_rng_state
from llmft.data import batch_targets
from llmft.errors import Problem, TrainingDiverged
from llmft.job import watchdog
from llmft.job.dist import DistEnv, all_reduce_sum, any_rank_stopping
from llmft.model.aux_loss import AuxSlot, Captured
from llmft.plan.batch import BatchPlan
from llmft.stop import StopRequest

if TYPE_CHECKING:
    from llmft.engines import Engine
    from llmft.objectives import Objective

log = logging.getLogger("llmft")


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    samples: int = 0  # position in the global sample order (samples consumed by all ranks)
    tokens: int = 0  # target tokens trained on
    stopped: str | None = None  # what stopped the run early (a signal name), if anything
    abandoned: str | None = None  # what a stop cut short in step ``step + 1`` (generation, scoring), if so
    saved: int | None = None  # the step whose checkpoint exists (written by this run, or resumed from)


@dataclass
class LoopHooks:
    """What the loop calls out to; ``run.Run.fit`` wires these to metrics, eval and checkpoints."""

    log_train: Callable[[dict[str, Any]], None]
    evaluate: Callable[[int], None]
    checkpoint: Callable[[LoopState], None]
    progress: Callable[[LoopState, dict[str, Any]], None] = lambda state, row: None
    extra_metrics: Callable[[dict[str, Any]], dict[str, Any]] = lambda row: {}


@dataclass
class LoopConfig:
    max_steps: int
    log_every: int = 1
    eval_every: int | None = None
    checkpoint_every: int | None = None


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # Tensors only: a preference batch carries its pair count as a python int.
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train_loop(
    engine: Engine,
    objective: Objective,
    scheduler,
    batches: Iterator[dict[str, torch.Tensor]],
    plan: BatchPlan,
    env: DistEnv,
    cfg: LoopConfig,
    state: LoopState,
    hooks: LoopHooks,
    stop: StopRequest,
) -> LoopState:
    model = engine.model
    model.train()
    state.saved = state.step if state.step > 0 else None  # resumed from its checkpoint
    with AuxSlot(engine.unwrap()) as aux:  # the terms attached inside the policy (none: no hook)
        run = _Run(engine, objective, aux, scheduler, batches, plan, env, cfg, hooks, stop)
        while state.step < cfg.max_steps:
            if _step(run, state):
                break
    return state


@dataclass(frozen=True)
class _Run:
    """What every step of one ``train_loop`` works with (its state apart: ``LoopState``)."""

    engine: Engine
    objective: Objective
    aux: AuxSlot
    scheduler: Any
    batches: Iterator[dict[str, torch.Tensor]]
    plan: BatchPlan
    env: DistEnv
    cfg: LoopConfig
    hooks: LoopHooks
    stop: StopRequest
    ahead: list = field(default_factory=list)  # the next step's micro-batches, fetched early (rollout.async)


def _step(run: _Run, state: LoopState) -> bool:
    """One optimizer step; whether the run stops after it (or instead of it: abandoned)."""
    device = run.env.device
    t0 = time.perf_counter()
    step = state.step + 1
    watchdog.progress(step, "fetching and counting the micro-batches")  # a stall: llmft.job.watchdog
    # All micro-batches of the step are fetched first: their items (target tokens, pairs) must
    # be counted before the first backward (each micro loss is divided by the global count).
    rng = rng_state()  # as the step begins: what a checkpoint of the state before it holds
    accumulation = run.plan.gradient_accumulation_steps
    fetched = run.ahead.pop() if run.ahead else [next(run.batches) for _ in range(accumulation)]
    if getattr(run.objective, "looks_ahead", False) and step < run.cfg.max_steps:
        # rollout.async: the next step's micro-batches now, so that their completions are drawn while
        # this step updates (the data position is the samples count, not the iterator: a resume is exact)
        run.ahead.append([next(run.batches) for _ in range(accumulation)])
        run.objective.look_ahead(run.ahead[-1])  # type: ignore[attr-defined]
    try:
        micro_batches = run.objective.prepare(fetched)  # generation and scoring, for online RL
    except stops.Abandoned as cut:
        _abandon(state, cut.what, rng, run.hooks, run.stop)
        return True
    data_wait = time.perf_counter() - t0
    local = local_sums(run.objective, run.aux, micro_batches, run.engine.autocast)
    num_items, global_count, global_targets = begin_step(run.aux, all_reduce_sum(local, device), device)

    last = run.plan.gradient_accumulation_steps - 1  # the boundary: gradients are reduced there
    loss_sum, metric_sums, aux_sums = _forward_backward(
        run.engine, run.objective, run.aux, micro_batches, num_items, step, last
    )

    # One all-reduce for the step's loss, the objective's metric sums, the auxiliary terms and the
    # stop flag: every rank sees the same decision.
    stop_vote = 1.0 if run.stop.requested else 0.0
    watchdog.progress(step, "the all-reduce of the loss and stop vote")
    loss_global, stop_votes, *sums_global = all_reduce_sum(
        [float(loss_sum), stop_vote, *metric_sums.tolist(), *aux_sums.tolist()], device
    )
    metrics_global, aux_global = sums_global[: len(metric_sums)], sums_global[len(metric_sums) :]
    _check_finite(step, loss_global, run.aux.metrics(aux_global))
    watchdog.progress(step, "the optimizer step")
    grad_norm = run.engine.step()  # clips to the plan's max_grad_norm
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    state.step += 1
    state.samples += run.plan.global_batch_size
    state.tokens += int(global_targets)
    step_time = time.perf_counter() - t0

    row = {
        "split": "train",
        "step": state.step,
        "loss": loss_global,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": int(global_targets),
        "tokens_per_s": global_targets / step_time,
        "step_time_s": step_time,
        "data_wait_frac": data_wait / step_time,
        "samples": state.samples,
        **run.objective.metrics(metrics_global, global_count),
        **run.aux.metrics(aux_global),
    }
    row.update(run.hooks.extra_metrics(row))
    if state.step % run.cfg.log_every == 0 or state.step == run.cfg.max_steps:
        run.hooks.log_train(row)
    run.hooks.progress(state, row)

    if _end_of_step(state, run.cfg, run.hooks, run.engine.model, device, stopping=stop_votes > 0):
        state.stopped = run.stop.requested or "a signal on another rank"
        return True
    return False


def local_sums(objective: Objective, aux: AuxSlot, micro_batches: list, autocast: Callable) -> list[float]:
    """This rank's sums that the step all-reduces before its first backward: the objective's count,
    the target tokens and the auxiliary terms' own statistics (none: just the two), the latter
    under the step's autocast, as a term's own forward (a router's pre-pass) must route as the step does."""
    count = sum(objective.count(mb) for mb in micro_batches)
    targets = sum(batch_targets(mb) for mb in micro_batches)
    with autocast():
        stats = aux.statistics(micro_batches)
    return [float(count), float(targets), *stats]


def begin_step(aux: AuxSlot, global_sums: list[float], device: torch.device) -> tuple[torch.Tensor, float, float]:
    """From ``local_sums`` summed over every rank: ``num_items`` (each micro loss's divisor), the
    global count and target tokens; the auxiliary terms get the step's counts and statistics."""
    count, targets, *stats = global_sums
    num_items = torch.tensor(max(count, 1.0), device=device)
    aux.begin_step(num_items, targets, stats)
    return num_items, count, targets


def micro_loss(
    objective: Objective, model: torch.nn.Module, aux: AuxSlot, mb: dict, num_items: torch.Tensor, autocast: Callable
) -> tuple[torch.Tensor, torch.Tensor | None, Captured]:
    """A micro-batch's loss and metric sums, and the auxiliary terms its forward gave: the backward
    takes ``terms.added_to(loss)``."""
    with autocast(), aux.capture(mb) as terms:
        loss, sums = objective.micro_loss(model, mb, num_items)
    return loss, sums, terms


def _forward_backward(
    engine: Engine,
    objective: Objective,
    aux: AuxSlot,
    micro_batches: list,
    num_items: torch.Tensor,
    step: int,
    last: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward of the step's micro-batches; this rank's sums of the objective's loss,
    of its metrics and of the auxiliary terms (float64)."""
    device = num_items.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    metric_sums = torch.zeros(len(objective.metric_names), device=device, dtype=torch.float64)
    aux_sums = torch.zeros(len(aux.terms), device=device, dtype=torch.float64)
    for k, mb in enumerate(micro_batches):
        boundary = k == last
        watchdog.progress(step, f"forward and backward of micro-batch {k + 1} of {len(micro_batches)}")
        mb = _to_device(mb, device)
        with engine.micro_step(boundary):
            loss, sums, terms = micro_loss(objective, engine.model, aux, mb, num_items, engine.autocast)
            engine.backward(terms.added_to(loss))  # the engine undoes its own averaging over ranks
        loss_sum += loss.detach().double()
        if sums is not None:
            metric_sums += sums.double()
        if terms.values:
            aux_sums += terms.detached()
    return loss_sum, metric_sums, aux_sums


def _check_finite(step: int, loss: float, aux: dict[str, float]) -> None:
    """The step's loss and auxiliary terms are finite, or the run stops before the optimizer step."""
    bad = [f"{name} is {value}" for name, value in aux.items() if not math.isfinite(value)]
    if math.isfinite(loss) and not bad:
        return
    what = ", ".join([f"the loss is {loss}" + (" (not finite)" if not math.isfinite(loss) else ""), *bad])
    raise TrainingDiverged(
        Problem(
            f"step {step}",
            f"{what}; no optimizer step was taken and the last checkpoint is untouched",
            "Lower optim.lr, enable optim.max_grad_norm, use bf16 instead of fp16, or check the data.",
        )
    )


def _end_of_step(state: LoopState, cfg: LoopConfig, hooks: LoopHooks, model, device, *, stopping: bool) -> bool:
    """Eval and checkpoint after a step, as the config and the stop vote say; whether the run stops here."""
    last = state.step == cfg.max_steps
    evaluated = False
    if cfg.eval_every and state.step % cfg.eval_every == 0 and not last and not stopping:
        try:
            with watchdog.idle("eval"):
                hooks.evaluate(state.step)
            evaluated = True
        except stops.Abandoned:  # every rank: the eval row is left out, the step is kept
            stopping = True
        model.train()
    if stopping or last or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0):
        _save(state, hooks)
    # A stop that came during the eval or the save: one vote, and the run stops here, with this
    # step's checkpoint, rather than after another step.
    if not stopping and not last and (evaluated or state.saved == state.step) and any_rank_stopping(device):
        stopping = True
        if state.saved != state.step:
            _save(state, hooks)
    return stopping


def _save(state: LoopState, hooks: LoopHooks) -> None:
    with watchdog.idle("the checkpoint"), stops.during(stops.SAVING):
        hooks.checkpoint(state)
    state.saved = state.step


def _abandon(state: LoopState, what: str, rng: dict[str, Any], hooks: LoopHooks, stop: StopRequest) -> None:
    """A stop cut the ``what`` of step ``state.step + 1`` short on every rank: nothing of that step
    was applied. The state before it is checkpointed (unless its checkpoint exists: the one resumed
    from, or the last step's), with the random state as the step began, so that the resumed run
    repeats the step exactly (generation is seeded by step, never by the random state)."""
    state.stopped = stop.requested or "a signal on another rank"
    state.abandoned = what
    if state.saved != state.step and state.step > 0:
        set_rng_state(rng)
        _save(state, hooks)
    after = f"step {state.step}'s checkpoint" if state.step > 0 else "the start (nothing was trained yet)"
    log.warning(
        "step %d abandoned: its %s was cut short by %s; none of it is applied, and the same command "
        "resumes from %s and does step %d again with the same seeds",
        state.step + 1, what, state.stopped, after, state.step + 1,
    )  # fmt: skip
