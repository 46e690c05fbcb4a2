"""The slot for auxiliary loss terms (llmft/model/aux_loss.py; docs/design.md, "The loss contract").

Two test terms are attached to the policy of a tiny fp32 llama and trained through the real loop
(one SGD step, its gradients captured): an L2 of the final hidden state over the target tokens,
normalised by the step's global target count (and asking the forward for ``output_hidden_states``),
and a per-row statistic normalised by its own count (rows, from ``statistics``, all-reduced with the
step's counts). Their gradients equal the hand-written total loss on one big batch, every split
gives the same gradients, each term is logged as ``aux/<name>`` beside the objective's own ``loss``,
activation checkpointing counts each term once, and no objective knows of the slot.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, write_recipe
from preference_batches import full_grads

from llmft.data import collate
from llmft.data.loader import count_targets
from llmft.model import aux_loss
from llmft.model.aux_loss import AuxLossBase, AuxSlot, StepCounts

GLOBAL = 4
SPLITS = [(4, 1), (2, 2), (1, 4)]
IGNORE = -100
L2_COEF, ROW_COEF = 0.01, 0.5


def _valid(batch: dict) -> torch.Tensor:
    """Positions that predict a target token (what ``count_targets`` counts), ``[R, T - 1]``."""
    return batch["labels"][:, 1:] != IGNORE


class HiddenL2(AuxLossBase):
    """coef * sum over target positions of |h|^2 (final hidden state) / the global target tokens."""

    name = "hidden_l2"
    forward_kwargs = {"output_hidden_states": True}

    def __init__(self) -> None:
        self.calls = 0

    def term(self, output, batch: dict, counts: StepCounts) -> torch.Tensor:
        self.calls += 1
        h = output.hidden_states[-1][:, :-1].float()
        return L2_COEF * (h.pow(2).sum(-1) * _valid(batch)).sum() / counts.targets


class RowMean(AuxLossBase):
    """coef * sum over rows of (mean of h over the row's target positions)^2 / the global rows: a
    normaliser of its own, from ``statistics``."""

    name = "row_mean"
    forward_kwargs = {"output_hidden_states": True}

    def __init__(self) -> None:
        self.calls = 0

    def statistics(self, micro_batches: list[dict]) -> list[float]:
        return [float(sum(mb["labels"].shape[0] for mb in micro_batches))]

    def term(self, output, batch: dict, counts: StepCounts) -> torch.Tensor:
        self.calls += 1
        return ROW_COEF * _row_means(output.hidden_states[-1], batch).pow(2).sum() / counts.statistics[0]


def _row_means(hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    valid = _valid(batch).float()
    h = hidden[:, :-1].float().mean(-1)
    return (h * valid).sum(1) / valid.sum(1).clamp_min(1.0)


def examples() -> list[dict]:
    """GLOBAL examples of very different lengths, their prompts masked."""
    rng = random.Random(0)
    out = []
    for n, masked in [(5, 2), (17, 3), (9, 0), (26, 11)][:GLOBAL]:
        ids = [rng.randrange(1, 256) for _ in range(n)]
        out.append({"input_ids": ids, "labels": [IGNORE] * masked + ids[masked:], "position_ids": None})
    return out


def _micro_batches(micro: int) -> list[dict]:
    exs = examples()
    return [collate(exs[i : i + micro], 0) for i in range(0, len(exs), micro)]


def _plan(tmp_path, micro: int, *extra: str):
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    overrides = [
        f"batch.global_batch_size={GLOBAL}",
        f"batch.micro_batch_size={micro}",
        "optim.name=sgd",
        "optim.max_grad_norm=null",
        *extra,
    ]
    return resolve(load_recipe(write_recipe(tmp_path), overrides))


def _engine(plan, env=None):
    from llmft.data.tokenizer import load_tokenizer
    from llmft.engines import build_engine
    from llmft.job.dist import DistEnv
    from llmft.training.optim import build_optimizer

    optim = plan.recipe.optim
    torch.manual_seed(0)
    tokenizer = load_tokenizer(plan.recipe.model)
    return build_engine(plan, env or DistEnv(), tokenizer, lambda m: build_optimizer(m, optim, optim.lr))


def loop_step(plan, env, micro_batches: list[dict], terms=(), before=lambda engine: None) -> tuple[dict, dict]:
    """One step of the real loop over this rank's ``micro_batches``, with ``terms`` attached to the
    policy: (the reduced gradients the optimizer stepped with, the logged row). Also run by
    tests/distributed/test_aux_loss_ranks.py on each of 2 ranks."""
    from llmft.objectives import build_objective
    from llmft.stop import StopRequest
    from llmft.training.loop import LoopConfig, LoopHooks, LoopState, train_loop
    from llmft.training.optim import build_scheduler

    engine = _engine(plan, env)
    for term in terms:
        aux_loss.attach(engine.unwrap(), term)
    before(engine)
    objective = build_objective(plan, engine)
    captured: dict[str, torch.Tensor] = {}
    step = engine.step

    def capture() -> float:
        captured.update(full_grads(engine))
        return step()

    engine.step = capture
    rows: list[dict] = []
    hooks = LoopHooks(log_train=rows.append, evaluate=lambda s: None, checkpoint=lambda s: None)
    scheduler = build_scheduler(engine.optimizer, plan.recipe.optim, 1)
    args = (engine, objective, scheduler, iter(micro_batches), plan.batch, env, LoopConfig(max_steps=1))
    train_loop(*args, LoopState(), hooks, StopRequest())
    assert not engine.unwrap()._forward_pre_hooks  # the slot left no hook
    return captured, rows[-1]


def _loop_step(tmp_path, micro: int, terms=(), *extra: str, before=lambda engine: None) -> tuple[dict, dict]:
    """One step in one process over the GLOBAL examples in micro-batches of ``micro``."""
    from llmft.job.dist import DistEnv

    plan = _plan(tmp_path / f"m{micro}", micro, *extra)
    return loop_step(plan, DistEnv(), _micro_batches(micro), terms, before)


def big_batch(tmp_path) -> tuple[dict, dict[str, float]]:
    """The hand-written total loss on one batch of all GLOBAL examples: the token-mean
    cross-entropy + both terms, each with its own normaliser; (its gradients, its values)."""
    model = _engine(_plan(tmp_path / "big", GLOBAL)).unwrap()
    model.train()
    batch = collate(examples(), 0)
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True, use_cache=False)
    tokens = count_targets(batch["labels"])
    logits = out.logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), reduction="sum")
    h = out.hidden_states[-1][:, :-1].float()
    l2 = L2_COEF * (h.pow(2).sum(-1) * _valid(batch)).sum() / tokens
    rows = ROW_COEF * _row_means(out.hidden_states[-1], batch).pow(2).sum() / batch["labels"].shape[0]
    (ce / tokens + l2 + rows).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    values = {"loss": ce / tokens, "aux/hidden_l2": l2, "aux/row_mean": rows}
    return grads, {k: float(v.detach()) for k, v in values.items()}


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_terms_give_the_big_batch_gradient_in_every_split_and_are_logged(tmp_path):
    ref, values = big_batch(tmp_path)
    results = {}
    for micro, acc in SPLITS:
        l2, rows = HiddenL2(), RowMean()
        grads, row = _loop_step(tmp_path, micro, (l2, rows))
        assert l2.calls == rows.calls == acc  # one term per micro-batch
        results[micro] = grads
        assert _max_abs_diff(grads, ref) < 1e-6, (micro, _max_abs_diff(grads, ref))
        # (iii) each term logged beside the loss, which stays the objective's alone
        assert row["loss"] == pytest.approx(values["loss"], rel=1e-6, abs=1e-7)
        assert row["aux/hidden_l2"] == pytest.approx(values["aux/hidden_l2"], rel=1e-6)
        assert row["aux/row_mean"] == pytest.approx(values["aux/row_mean"], rel=1e-6)
    for micro, _ in SPLITS[1:]:
        assert _max_abs_diff(results[micro], results[GLOBAL]) < 1e-6
    # The terms matter: without them the gradient is measurably another one.
    plain, row = _loop_step(tmp_path / "plain", 2)
    assert _max_abs_diff(plain, ref) > 1e-3
    assert not [k for k in row if k.startswith("aux/")]


def test_activation_checkpointing_counts_each_term_once(tmp_path):
    """With checkpointing on, the backward re-runs each decoder layer's forward (a hook on a module
    inside it, a router's, would fire twice), never the policy's own forward, where the slot hooks:
    each term once, the same gradient."""
    ref, values = big_batch(tmp_path)
    l2, rows = HiddenL2(), RowMean()
    layer_calls = []

    def probe(engine) -> None:
        assert engine.unwrap().is_gradient_checkpointing
        engine.unwrap().model.layers[0].mlp.act_fn.register_forward_hook(lambda *a: layer_calls.append(1))

    grads, row = _loop_step(tmp_path / "gc", 2, (l2, rows), "model.gradient_checkpointing=true", before=probe)
    assert len(layer_calls) == 4  # two micro-batches, the MLP activation re-run in backward: checkpointing is on
    assert l2.calls == rows.calls == 2  # two micro-batches, each term once
    assert _max_abs_diff(grads, ref) < 1e-6, _max_abs_diff(grads, ref)
    assert row["aux/hidden_l2"] == pytest.approx(values["aux/hidden_l2"], rel=1e-6)
    assert row["aux/row_mean"] == pytest.approx(values["aux/row_mean"], rel=1e-6)


def test_a_term_that_is_not_finite_stops_the_step_before_the_optimizer(tmp_path):
    from llmft.errors import TrainingDiverged

    class Broken(AuxLossBase):
        name = "broken"

        def term(self, output, batch, counts):
            return output.logits.sum() * float("nan")

    stepped = []
    with pytest.raises(TrainingDiverged) as err:
        _loop_step(tmp_path, 2, (Broken(),), before=lambda engine: setattr(engine, "step", lambda: stepped.append(1)))
    assert "step 1" in str(err.value) and "aux/broken is nan" in str(err.value)
    assert "no optimizer step was taken" in str(err.value) and not stepped


def test_an_empty_slot_changes_nothing():
    """No term attached: no hook on the model, the loss handed to the backward is the objective's
    own tensor, no statistic rides on the all-reduce, no aux/ key in the row."""
    model = torch.nn.Linear(2, 2)
    with AuxSlot(model) as slot:
        assert not model._forward_hooks and not model._forward_pre_hooks
        assert slot.statistics([{"labels": torch.zeros(1, 2)}]) == []
        loss = torch.tensor(1.5, requires_grad=True)
        with slot.capture({}) as terms:
            pass
        assert terms.added_to(loss) is loss
        assert slot.metrics([]) == {}


def test_the_slot_hooks_only_while_armed_and_with_gradients():
    """A term is computed only for a forward with gradients inside ``capture`` (not an eval
    forward, not a no-grad reference pass inside the loss), and its forward kwargs likewise."""
    seen = []

    class Probe(AuxLossBase):
        name = "probe"
        forward_kwargs = {"scale": 2.0}

        def term(self, output, batch, counts):
            seen.append(output)
            return output.sum() / counts.targets

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x, scale=1.0):
            return self.w * x * scale

    model = Scaled()
    aux_loss.attach(model, Probe())
    x = torch.ones(3)
    with AuxSlot(model) as slot:
        slot.statistics([])
        slot.begin_step(torch.tensor(1.0), 3.0, [])
        assert model(x).tolist() == [1.0, 1.0, 1.0] and not seen  # not armed: untouched
        with slot.capture({}) as terms:
            with torch.no_grad():
                assert model(x).tolist() == [1.0, 1.0, 1.0]  # no grad: untouched
            assert model(x).tolist() == [2.0, 2.0, 2.0]  # armed: the term's kwargs
        assert len(seen) == 1 and terms.detached().tolist() == [2.0]
        assert float(terms.added_to(torch.tensor(1.0)).detach()) == 3.0
        assert slot.metrics([2.0]) == {"aux/probe": 2.0}
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_no_objective_knows_the_slot():
    """The objectives never name the slot: a term reaches the loss through the loop alone."""
    pattern = re.compile(r"\baux|AuxLoss|AuxSlot", re.IGNORECASE)
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "llmft" / "objectives").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
