"""Auxiliary loss terms: what a model component adds to the step's loss beside the objective's
(a mixture-of-experts router's load-balancing loss, a z-loss), without any objective knowing of it.

A component attaches a term to its module (``attach(module, term)``: the policy or any module in
it, e.g. when the model is built); the training loop finds every term attached inside the policy
(``AuxSlot(engine.unwrap())``) and, when there is none, runs exactly as without this module (no
hook, no extra value in any all-reduce, the loss untouched).

A term (the ``AuxLoss`` Protocol; ``AuxLossBase`` gives the defaults) follows the loss contract
(docs/design.md, "The loss contract"): its value on a micro-batch is a sum over that micro-batch
divided by a count of the WHOLE global batch known before the first backward, so that the summed
gradients of any split (micro x accumulation x ranks) equal one big batch's. Each step:

1. ``statistics(micro_batches)``: after the step's micro-batches are fetched (and prepared by the
   objective), before any forward: this rank's sums of what the term needs over the global batch
   (its own normaliser, or a global statistic). They are all-reduced in the one all-reduce of the
   step's counts and handed back, summed over every rank, as ``StepCounts.statistics``.
2. ``forward_kwargs``: extra arguments of the policy's forward (``output_router_logits=True``,
   ``output_hidden_states=True``), added by a forward pre-hook of the slot.
3. ``term(output, batch, counts)``: called with the model output of each forward of the policy
   that runs with gradients during a micro-batch's loss (one per micro-batch for every built-in
   objective; a no-grad forward such as a reference pass with the adapters off is not one), from a
   forward hook of the slot; it returns a scalar with its graph. The loop adds it to the
   micro-batch's loss before the backward. The hook is armed only while the objective computes
   the micro-batch's loss, so a forward that activation checkpointing re-runs during the backward
   never counts twice (HF's checkpointing re-runs decoder layers, never the policy's own forward).

A term reads the model's output, not its parameters (under FSDP2 and ZeRO-3 they are sharded
outside the module's own forward). Its value, the step's sum over every micro-batch and rank, is
logged as ``aux/<name>`` beside ``loss``, which stays the objective's alone; what the optimizer
minimises is ``loss`` plus every ``aux/<name>``. A term may log metrics of its own beside it, from the step's
all-reduced statistics (``metrics``: a router's expert load).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol, Sequence

import torch

METRIC_PREFIX = "aux/"


@dataclass(frozen=True)
class StepCounts:
    """The step's global counts, known before its first backward (every rank the same)."""

    items: torch.Tensor  # the objective's global count (``num_items``: target tokens, pairs, completions), >= 1
    targets: torch.Tensor  # the global batch's target tokens, >= 1
    statistics: torch.Tensor  # this term's ``statistics``, summed over every rank (empty: it has none)


class AuxLoss(Protocol):
    name: str  # logged as ``aux/<name>``; unique in a model
    forward_kwargs: Mapping[str, Any]  # extra arguments of the policy's forward while the term is computed

    def statistics(self, micro_batches: list[dict[str, Any]]) -> Sequence[float]:
        """This rank's sums over the step's micro-batches of what the term needs over the global
        batch (all-reduced with the step's counts); () for none."""

    def term(self, output: Any, batch: dict[str, Any], counts: StepCounts) -> torch.Tensor:
        """This micro-batch's term from the policy's ``output``: a sum over ``batch`` divided by a
        global count (``counts``), a scalar with its graph."""

    def metrics(self, statistics: torch.Tensor) -> dict[str, float]:
        """Metrics of its own from the step's all-reduced ``statistics`` (logged beside ``aux/<name>``)."""


class AuxLossBase:
    """The defaults of an ``AuxLoss``: no extra forward arguments, no statistics of its own (a term
    normalised by ``counts.targets`` or ``counts.items``). Subclasses set ``name`` and write ``term``."""

    name: str = "aux"
    forward_kwargs: Mapping[str, Any] = {}

    def statistics(self, micro_batches: list[dict[str, Any]]) -> Sequence[float]:
        return ()

    def metrics(self, statistics: torch.Tensor) -> dict[str, float]:
        return {}


_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, list[AuxLoss]] = weakref.WeakKeyDictionary()


def attach(module: torch.nn.Module, term: AuxLoss) -> None:
    """Add ``term`` to the step's loss of every run whose policy holds ``module``."""
    _ATTACHED.setdefault(module, []).append(term)


def attached(model: torch.nn.Module) -> list[AuxLoss]:
    """The terms attached to ``model`` or any module inside it, in module order."""
    terms = [t for m in model.modules() for t in _ATTACHED.get(m, ())]
    names = [t.name for t in terms]
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"auxiliary loss terms share a name: {dup}"
    return terms


class AuxSlot:
    """The terms attached inside ``model`` (the policy: the module the engine wraps), hooked onto
    its forward for a training loop. Empty: no hook, and every method a no-op."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.terms = attached(model)
        self.names = tuple(METRIC_PREFIX + t.name for t in self.terms)
        self._kwargs = _merged_kwargs(self.terms)
        self._sizes: list[int] = []
        self._counts: list[StepCounts] = []
        self._capture: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._handles = []
        if self.terms:
            self._handles = [
                model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                model.register_forward_hook(self._post_forward, with_kwargs=True),
            ]

    def __enter__(self) -> AuxSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def statistics(self, micro_batches: list[dict[str, Any]]) -> list[float]:
        """Every term's local statistics, one flat list (appended to the step's count all-reduce)."""
        stats = [[float(v) for v in t.statistics(micro_batches)] for t in self.terms]
        self._sizes = [len(s) for s in stats]
        return [v for s in stats for v in s]

    def begin_step(self, items: torch.Tensor, targets: float, statistics: list[float]) -> None:
        """The step's global counts and the all-reduced ``statistics``, before the first forward."""
        if not self.terms:
            return
        targets_t = torch.tensor(max(targets, 1.0), device=items.device)
        stats = torch.tensor(statistics, device=items.device)
        parts = torch.split(stats, self._sizes) if stats.numel() else [stats] * len(self.terms)
        self._counts = [StepCounts(items, targets_t, part) for part in parts]

    @contextmanager
    def capture(self, batch: dict[str, Any]) -> Iterator[Captured]:
        """Arms the hooks while the objective computes ``batch``'s loss; the terms, once it returns."""
        captured = Captured([])
        if not self.terms:
            yield captured
            return
        self._capture = (batch, captured.values)
        try:
            yield captured
        finally:
            self._capture = None
        assert captured.values, "no forward of the policy with gradients ran for the micro-batch's loss"

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """``aux/<name>``: each term's value over the global batch (its all-reduced sum over micro-batches),
        and each term's own metrics of the step's statistics."""
        out = dict(zip(self.names, sums, strict=True))
        for term, counts in zip(self.terms, self._counts, strict=True):
            out.update(term.metrics(counts.statistics))
        return out

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._capture is None or not torch.is_grad_enabled() or not self._kwargs:
            return None
        return args, {**kwargs, **self._kwargs}

    def _post_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._capture is None or not torch.is_grad_enabled():
            return
        batch, values = self._capture
        terms = [t.term(output, batch, c) for t, c in zip(self.terms, self._counts, strict=True)]
        if values:  # a second forward of the same micro-batch's loss: its terms add up
            terms = [a + b for a, b in zip(values, terms, strict=True)]
        values[:] = terms


@dataclass
class Captured:
    """The terms of one micro-batch, one scalar per attached term (empty when none is attached)."""

    values: list[torch.Tensor]

    def added_to(self, loss: torch.Tensor) -> torch.Tensor:
        """What the backward takes: ``loss`` itself when no term is attached, else loss + the terms."""
        for value in self.values:
            loss = loss + value
        return loss

    def detached(self) -> torch.Tensor:
        """The terms' values, float64, on their device (summed over the step without a sync)."""
        return torch.stack([v.detach().double() for v in self.values])


def _merged_kwargs(terms: list[AuxLoss]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for t in terms:
        for key, value in t.forward_kwargs.items():
            assert merged.get(key, value) == value, (
                f"auxiliary loss {t.name} asks {key}={value!r}, another {merged[key]!r}"
            )
            merged[key] = value
    return merged
