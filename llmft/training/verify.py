"""``llmft verify``: prove on the user's own data and model that accumulation is the big batch.

One optimizer step's gradient is computed three ways from the same weights and
the first global batch of the real data order (``GlobalOrder`` +
``MicroBatchSampler``, exactly the items step 1 of ``llmft train`` sees), with
the run's own objective (``llmft.objectives``: SFT counts target tokens, ``dpo``
and ``reward`` count pairs, ``ObjectiveSpec.counts``):

- **big batch**: one forward/backward of all G items (sequences, or pairs), loss
  = the objective's loss of that one batch, normalised by its own count (for
  SFT transformers' token mean);
- **llmft**: the configured split, computed as ``loop.py`` does it: each micro
  loss is the objective's numerator divided by the count (target tokens, pairs)
  of the whole global batch, gradients summed over the micro-steps;
- **naive**: each micro loss is its own mean (normalised by its own count)
  divided by the number of micro-batches (what per-micro-batch averaging gives:
  TRL's DPO), shown so that the user sees the size of the error llmft avoids.

The auxiliary terms a model component attaches to the policy (``llmft.model.aux_loss``: an MoE
router's balancing loss) are part of every computation, through the loop's own functions
(``loop.local_sums``, ``begin_step``, ``micro_loss``): their statistics summed over the emulated
ranks as the step's all-reduce sums them, each term added to its micro loss. The big batch is one
step of one micro-batch; naive takes each micro-batch as a step of its own. A term's value
accumulated over the split is compared with the big batch's too.

A preference run builds its reference as training does in one process
(``Engine.frozen_model``, ``llmft.engines.base.OneProcessModels``: LoRA's is the policy with adapters
disabled, a full fine-tune's a frozen copy, or the named model).

Relative differences ``|g - g_big| / |g_big|`` are reported per trainable
tensor and over all of them; the check fails when the largest one exceeds the
tolerance. Only trainable parameters are compared, so a quantized base is fine.

Data-parallel ranks are emulated in one process. The layout is the recipe's
own (``distributed.nnodes x nproc_per_node``, as ``llmft compile`` plans it;
override those keys to check another). Rank r takes the contiguous slice r of
the global batch, as ``MicroBatchSampler`` deals it, accumulates its
micro-batches, and the ranks' gradients are then summed: what DDP/FSDP/
DeepSpeed produce after their ``backward`` undoes their averaging (see
docs/batch.md). Communication itself is not exercised; the distributed tests
cover that.

The check runs in fp32 unless ``model.dtype`` is overridden (in bf16/fp16 the
two computations legitimately differ by ~1e-2), with dropout switched off (its
masks would differ between the two computations; randomness is not what is
being checked). Limitations: the whole training set is tokenized first (the
data order is a permutation of all of it), and the big batch must fit in
memory as one forward/backward; a CUDA out-of-memory error is reported with the
``--samples`` values that shrink it (on CPU the operating system may simply
kill the process: use ``--samples`` up front for large models).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmft.data import MicroBatchSampler, build_data, collate
from llmft.data.tokenizer import load_tokenizer
from llmft.engines import autocast_for
from llmft.engines.base import OneProcessModels
from llmft.errors import Problem, UserError
from llmft.job.dist import DistEnv
from llmft.model.aux_loss import METRIC_PREFIX, AuxSlot, Captured
from llmft.model.build import prepare_model
from llmft.model.precision import compute_dtype
from llmft.model.structure import describe
from llmft.objectives import Objective, ObjectiveSetup, build_objective
from llmft.plan.batch import BatchPlan, divisors
from llmft.plan.layout import RunPlan
from llmft.plan.objectives import DEFAULT_OBJECTIVE
from llmft.plan.resolve import load_plan
from llmft.training.loop import begin_step, local_sums, micro_loss
from llmft.training.run import seed_everything

WORST_SHOWN = 5  # tensors listed in the table besides the global row

Grads = dict[str, torch.Tensor]
LossFn = Callable[[dict[str, Any]], tuple[torch.Tensor, Captured]]  # a micro-batch's loss and its terms


@dataclass
class TensorDiff:
    name: str
    ref_norm: float  # |g_big| of this tensor
    llmft: float  # relative difference of llmft's accumulated gradient
    naive: float  # relative difference of per-micro-batch mean averaging


@dataclass
class VerifyResult:
    plan: BatchPlan  # the split that was checked (global = the items used)
    configured_global: int  # the recipe's global batch (plan.global_batch_size < it with --samples)
    targets: list[list[int]]  # the objective's count (target tokens, or pairs) per rank, per micro-batch
    losses: dict[str, float]  # big, llmft, naive: the step's loss as each computation sees it
    overall: TensorDiff  # all trainable tensors as one vector
    tensors: list[TensorDiff] = field(default_factory=list)
    dtype: str = "fp32"
    device: str = "cpu"
    params: str = ""
    counts: str = "tokens"  # what the objective normalises by (ObjectiveSpec.counts)
    objective: str = DEFAULT_OBJECTIVE
    aux: dict[str, dict[str, float]] = field(default_factory=dict)  # aux/<name> -> big, llmft, naive

    @property
    def worst(self) -> TensorDiff:
        return max(self.tensors, key=lambda t: t.llmft)

    @property
    def grad_rel_diff(self) -> float:
        """The worst tensor's relative difference or the whole's, whichever is larger."""
        return max(self.overall.llmft, self.worst.llmft)

    @property
    def aux_rel_diffs(self) -> dict[str, float]:
        """aux/<name> -> |llmft - big| / |big| of the term's value over the step."""
        return {name: _ratio(abs(v["llmft"] - v["big"]), abs(v["big"])) for name, v in self.aux.items()}

    @property
    def max_rel_diff(self) -> float:
        """The number compared with the tolerance: the gradient's, or an auxiliary term's value's if larger."""
        return max([self.grad_rel_diff, *self.aux_rel_diffs.values()])


def verify(
    recipe_path: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    tolerance: float = 1e-4,
    samples: int | None = None,
) -> int:
    """Run the check, print the table; 0 when within ``tolerance``, 1 otherwise."""
    if not tolerance > 0:
        raise UserError(Problem("--tolerance", f"must be > 0, got {tolerance}", "Use e.g. --tolerance 1e-4."))
    result = check_gradients(load_for_verify(recipe_path, overrides), samples=samples)
    print(render(result, tolerance, title=f"llmft verify {recipe_path}"))
    if result.max_rel_diff <= tolerance:
        return 0
    print(f"llmft verify: error: {failure_message(result, tolerance)}", file=sys.stderr)
    return 1


def load_for_verify(recipe_path: str, overrides: list[str] | tuple[str, ...] = ()) -> RunPlan:
    """The run on its own layout (its dp is emulated), in fp32 unless ``model.dtype`` is overridden."""
    # Later overrides win, so a user's model.dtype=bf16 replaces this default.
    return load_plan(recipe_path, ["model.dtype=fp32", *overrides])


def split_for_samples(plan: BatchPlan, samples: int | None) -> BatchPlan:
    """``--samples N``: the first N items (sequences, or pairs), same micro-batch and ranks, fewer accumulation steps."""
    if samples is None:
        return plan
    unit = plan.micro_batch_size * plan.dp_size
    valid = [n for n in range(unit, plan.global_batch_size + 1, unit)]
    if samples < 1 or samples > plan.global_batch_size or samples % unit:
        raise UserError(
            Problem(
                "--samples",
                f"{samples} cannot keep the split whole: it must be a multiple of micro {plan.micro_batch_size} x "
                f"data-parallel {plan.dp_size} = {unit}, at most the global batch {plan.global_batch_size}",
                f"Use one of {_fmt_list(valid)}.",
            )
        )
    return BatchPlan(samples, plan.micro_batch_size, samples // unit, plan.dp_size)


def check_gradients(run: RunPlan, *, samples: int | None = None) -> VerifyResult:
    """Build the model once, compute the three gradients of the first global batch, compare them."""
    recipe = run.recipe
    configured = run.batch
    plan = split_for_samples(configured, samples)
    seed_everything(recipe.run.seed)
    tokenizer = load_tokenizer(recipe.model)
    data = build_data(recipe, tokenizer)
    device = DistEnv().device
    one = run.on_one_process()  # the ranks are emulated in this process
    model = prepare_model(one, tokenizer, device)
    objective = _objective(one, model, tokenizer, device)
    objective.setup(ObjectiveSetup(data, DistEnv(), tokenizer))  # as a run sets it up, before its first step
    _switch_off_dropout(model)
    order = data.order(recipe.run.seed, recipe.data.shuffle)  # streamed data orders itself
    ranks, big = _first_step(data.train, order, plan, tokenizer.pad_token_id)
    # As the loop does, before counting: the step's micro-batches of every (emulated) rank together,
    # which is what an objective that needs the whole step (GRPO's group advantages) sees through
    # its collectives; then split back per rank.
    prepared = iter(objective.prepare([mb for micro_batches in ranks for mb in micro_batches]))
    ranks = [[next(prepared) for _ in micro_batches] for micro_batches in ranks]
    (big,) = objective.prepare([big])
    dtype = compute_dtype(recipe)

    def autocast():
        return autocast_for(dtype, device)

    targets = [[objective.count(mb) for mb in micro_batches] for micro_batches in ranks]
    per_step = sum(len(micro_batches) for micro_batches in ranks)  # accumulation x dp
    with AuxSlot(model) as aux:  # the policy's auxiliary terms, hooked as the loop hooks them (none: no hook)

        def step_of(step: list[list[dict[str, Any]]]) -> torch.Tensor:
            """Begin a step over ``step`` (each rank's micro-batches), its sums summed as the all-reduce does."""
            local = [local_sums(objective, aux, micro_batches, autocast) for micro_batches in step]
            return begin_step(aux, [sum(column) for column in zip(*local, strict=True)], device)[0]

        def loss_of(batch: dict[str, Any], num_items: torch.Tensor) -> tuple[torch.Tensor, Captured]:
            loss, _, terms = micro_loss(objective, model, aux, _to(batch, device), num_items, autocast)
            return loss, terms

        def naive_of(mb: dict[str, Any]) -> tuple[torch.Tensor, Captured]:
            loss, terms = loss_of(mb, step_of([[mb]]))  # the micro-batch as a step of its own
            return loss / per_step, Captured([value / per_step for value in terms.values])

        g_big, loss_big, aux_big = _big_batch_grads(model, big, lambda b: loss_of(b, step_of([[b]])), plan, _items(run))
        num_items = step_of(ranks)
        g_llmft, loss_llmft, aux_llmft = _accumulated_grads(model, ranks, lambda mb: loss_of(mb, num_items))
        llmft = _compare(g_big, g_llmft)
        del g_llmft
        g_naive, loss_naive, aux_naive = _accumulated_grads(model, ranks, naive_of)
        naive = _compare(g_big, g_naive)
        names = [METRIC_PREFIX + term.name for term in aux.terms]
    tensors = [TensorDiff(name, *llmft[name][:2], naive[name][1]) for name in g_big]
    overall = TensorDiff("all", *llmft[None][:2], naive[None][1])
    return VerifyResult(
        plan=plan,
        configured_global=configured.global_batch_size,
        targets=targets,
        losses={"big": loss_big, "llmft": loss_llmft, "naive": loss_naive},
        overall=overall,
        tensors=tensors,
        dtype=recipe.model.dtype,
        device=str(device),
        params=describe(model),
        counts=run.objective_spec.counts,
        objective=run.objective,
        aux={
            name: {"big": big_v, "llmft": llmft_v, "naive": naive_v}
            for name, big_v, llmft_v, naive_v in zip(names, aux_big, aux_llmft, aux_naive, strict=True)
        },
    )


def _objective(plan: RunPlan, model: torch.nn.Module, tokenizer: Any, device: torch.device) -> Objective:
    """The run's objective over ``model``, with the reference a preference run builds in one process."""
    return build_objective(plan, OneProcessModels(plan, model, tokenizer, device))


def _items(plan: RunPlan) -> str:
    """What one item of the batch is, in messages (its record's ``unit``)."""
    return plan.objective_spec.unit


def _first_step(dataset, order, plan: BatchPlan, pad_id: int):
    """Step 1's micro-batches per rank, and the same sequences as one batch."""
    ranks, indices = [], []
    for rank in range(plan.dp_size):
        sampler = MicroBatchSampler(order, plan, rank, num_steps=1)
        lists = list(sampler)
        indices += [i for micro in lists for i in micro]
        ranks.append([collate([dataset[i] for i in micro], pad_id) for micro in lists])
    one_batch = BatchPlan(plan.global_batch_size, plan.global_batch_size, 1, 1)
    (whole,) = MicroBatchSampler(order, one_batch, 0, num_steps=1)
    assert whole == indices, "the ranks' micro-batches must tile the global batch in order"
    return ranks, collate([dataset[i] for i in whole], pad_id)


def _switch_off_dropout(model: torch.nn.Module) -> None:
    """Training mode (as the loop runs it), but deterministic: no dropout anywhere."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.eval()
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # HF attention applies it functionally while training


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _take_grads(model: torch.nn.Module) -> Grads:
    """The trainable parameters' gradients (copied to CPU, fp32), then cleared."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros(p.shape, device=p.device)
            out[name] = g.detach().to("cpu", torch.float32, copy=True)
    model.zero_grad(set_to_none=True)
    return out


def _big_batch_grads(
    model, batch, loss_of: LossFn, plan: BatchPlan, items: str = "sequences"
) -> tuple[Grads, float, list[float]]:
    model.zero_grad(set_to_none=True)
    device = next(model.parameters(), torch.empty(0)).device
    try:
        loss, terms = loss_of(batch)  # the big batch's own mean (SFT: transformers' token mean)
        terms.added_to(loss).backward()
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        raise UserError(
            Problem(
                "--samples",
                f"the big batch of {plan.global_batch_size} {items} does not fit in {device} memory as one "
                "forward/backward (the check needs it as the reference)",
                f"Check a smaller batch with the same micro-batch and ranks: --samples {_fmt_list(_smaller(plan))}.",
            )
        ) from None
    return _take_grads(model), float(loss.detach()), [float(v.detach()) for v in terms.values]


def _smaller(plan: BatchPlan) -> list[int]:
    unit = plan.micro_batch_size * plan.dp_size
    return [unit * d for d in divisors(plan.gradient_accumulation_steps)][:-1] or [unit]


def _accumulated_grads(model, ranks, loss_of: LossFn) -> tuple[Grads, float, list[float]]:
    """Each emulated rank accumulates its micro-batches; the ranks' gradients are summed (the all-reduce).
    ``loss_of``: a micro-batch's loss and auxiliary terms (the loop's: over the global count; naive: its
    own mean / micro-steps). Also the sums of the losses and of each term, as the loop logs them."""
    total: Grads = {}
    loss_sum, aux_sums = 0.0, []
    model.zero_grad(set_to_none=True)
    for micro_batches in ranks:
        for mb in micro_batches:
            loss, terms = loss_of(mb)
            terms.added_to(loss).backward()
            loss_sum += float(loss.detach())
            values = [float(v.detach()) for v in terms.values]
            aux_sums = [a + v for a, v in zip(aux_sums, values, strict=True)] if aux_sums else values
        rank_grads = _take_grads(model)
        total = rank_grads if not total else {k: total[k].add_(v) for k, v in rank_grads.items()}
    return total, loss_sum, aux_sums


def _compare(ref: Grads, got: Grads) -> dict[str | None, tuple[float, float]]:
    """name -> (|ref|, |got - ref| / |ref|); key None holds all tensors as one vector.

    A tensor whose reference gradient is exactly zero (e.g. LoRA A while B is still zero) is
    measured against the norm of the whole gradient instead of its own.
    """
    sq_ref = sq_diff = 0.0
    out: dict[str | None, tuple[float, float]] = {}
    norms = {}
    for name, r in ref.items():
        r64, d64 = r.double(), got[name].double() - r.double()
        norms[name] = (float(r64.norm()), float(d64.norm()))
        sq_ref += norms[name][0] ** 2
        sq_diff += norms[name][1] ** 2
    whole = math.sqrt(sq_ref)
    for name, (ref_norm, diff_norm) in norms.items():
        out[name] = (ref_norm, _ratio(diff_norm, ref_norm or whole))
    out[None] = (whole, _ratio(math.sqrt(sq_diff), whole))
    return out


def _ratio(diff: float, ref: float) -> float:
    if ref > 0:
        return diff / ref
    return 0.0 if diff == 0 else math.inf


def _fmt_list(values: list[int], limit: int = 10) -> str:
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def _fmt_targets(targets: list[list[int]], counts: str = "tokens") -> str:
    total = sum(map(sum, targets))
    noun = "target tokens" if counts == "tokens" else counts
    flat = [t for rank in targets for t in rank]
    if len(flat) > 16:
        detail = f"per micro-batch {min(flat)} to {max(flat)}"
    else:
        detail = "per micro-batch " + " | ".join(" ".join(map(str, rank)) for rank in targets)
        if len(targets) > 1:
            detail += " (ranks separated by |)"
    return f"{total} {noun}; {detail}"


def render(result: VerifyResult, tolerance: float, title: str = "llmft verify") -> str:
    plan = result.plan
    used = (
        "the first global batch of the data order"
        if plan.global_batch_size == result.configured_global
        else f"--samples: the first {plan.global_batch_size} of global batch {result.configured_global}"
    )
    ranks = (
        f"; {plan.dp_size} ranks emulated in one process, their gradients summed as DDP/FSDP do"
        if plan.dp_size > 1
        else ""
    )
    lines = [
        title,
        f"split:   {plan.equation()}",
        f"data:    {used}{ranks}",
        f"{'targets:' if result.counts == 'tokens' else result.counts + ':':<8} "
        f"{_fmt_targets(result.targets, result.counts)}",
        f"model:   {result.params}, {result.dtype} on {result.device}",
        f"loss:    {result.objective}, "
        + "big batch {big:.6f}, llmft accumulated {llmft:.6f}, naive per-micro-batch mean {naive:.6f}".format(
            **result.losses
        ),
        *(
            f"aux:     {name}, big batch {v['big']:.6f}, llmft accumulated {v['llmft']:.6f}, "
            f"naive per-micro-batch {v['naive']:.6f} (added to the loss)"
            for name, v in result.aux.items()
        ),
        "",
        "relative difference of the gradient to the big batch's, |g - g_big| / |g_big|",
    ]
    worst = sorted(result.tensors, key=lambda t: t.llmft, reverse=True)[:WORST_SHOWN]
    rows = [(f"all {len(result.tensors)} trainable tensors", result.overall)]
    rows += [(t.name, t) for t in worst]
    width = max(len(name) for name, _ in rows)
    lines.append(f"{'parameter':<{width}}  {'|g_big|':>9}  {'llmft':>9}  {'naive':>9}")
    for name, t in rows:
        lines.append(f"{name:<{width}}  {t.ref_norm:9.3e}  {t.llmft:9.2e}  {t.naive:9.2e}")
    if len(result.tensors) > len(worst):
        lines.append(
            f"({len(result.tensors) - len(worst)} more tensors not shown, none with a larger llmft difference)"
        )
    lines.append("")
    verdict = "PASS" if result.max_rel_diff <= tolerance else "FAIL"
    lines.append(
        f"{verdict}: largest relative difference {result.max_rel_diff:.2e} "
        f"{'<=' if verdict == 'PASS' else '>'} tolerance {tolerance:g}; "
        f"per-micro-batch mean averaging would be off by {result.overall.naive:.2e}"
    )
    return "\n".join(lines)


def failure_message(result: VerifyResult, tolerance: float) -> str:
    off = {name: d for name, d in result.aux_rel_diffs.items() if d > tolerance}
    if off:
        name = max(off, key=off.get)
        v = result.aux[name]
        return (
            f"the auxiliary term {name} accumulated over the split is {v['llmft']:.6f}, the big batch's "
            f"{v['big']:.6f}: relative difference {off[name]:.2e}, more than --tolerance {tolerance:g} (the "
            f"accumulated gradient differs by {result.grad_rel_diff:.2e}). A term computed per micro-batch depends "
            "on the split: for the router's balancing loss use moe.balance: global_batch (docs/moe.md)."
        )
    worst = result.worst if result.worst.llmft >= result.overall.llmft else result.overall
    hint = (
        f"In {result.dtype} some difference is rounding: rerun in fp32 (drop the model.dtype override) "
        "or raise --tolerance."
        if result.dtype != "fp32"
        else "In fp32 the difference should be ~1e-6: a larger one means this model's loss ignores "
        "num_items_in_batch or its forward depends on the batch (BatchNorm, MoE capacity limits); "
        "a slightly larger one can be rounding on very deep models (raise --tolerance)."
        if result.counts == "tokens"
        else "In fp32 the difference should be ~1e-6: a larger one means this model's forward depends on the "
        "batch (BatchNorm, MoE capacity limits, padding); a slightly larger one can be rounding on very deep "
        "models (raise --tolerance)."
    )
    return (
        f"gradient accumulation is not equivalent to the big batch within tolerance: the accumulated gradient "
        f"differs by {result.grad_rel_diff:.2e} (relative, {worst.name}), more than --tolerance {tolerance:g}. " + hint
    )
