"""``estimate_memory`` against what a tiny model really holds on CPU, component by component.

The model is trained the way llmft trains it (``SingleEngine``: the loop's forward with
``num_items_in_batch``, ``engine.backward``, ``engine.step``), so these are the bytes the
engines allocate, not a re-derivation of the formulas.

- Weights, gradients and AdamW state are measured exactly, from tensor sizes after a step, and
  must equal the estimate to the byte (AdamW's per-tensor ``step`` counters, 4 bytes per
  parameter tensor, are the only state the estimate leaves out; they are checked separately).
- Activations: the peak of live tensor storage during one micro-step's forward + backward,
  tracked op by op with a ``TorchDispatchMode`` (every tensor an op returns is recorded until its
  storage is freed; storages alive before the micro-step, weights, gradients, optimizer state
  and the batch, are not counted). That peak (saved activations, the logits and their
  log-softmax, and the first gradients of backward) is compared with the estimate's
  ``activations + logits``. The estimate is what must fit, a per-token tally of what a Llama
  layer keeps for backward (``activation_bytes_per_token_layer``) plus the logits, so the band
  is lopsided: it may over-count by up to 25 % (with eager attention it counts the scores and
  their softmax, and only the softmax is kept: measured -12 %; sdpa -5 %) and under-count by at
  most 10 % (backward temporaries it does not itemise). The band still fails if a component is
  dropped (the logits alone are over a quarter of the total) or counted twice.
- Under gradient checkpointing one recomputed layer and the logits are never alive together
  (the head's backward frees the logits before any layer is recomputed), so the estimate counts
  the larger of the two, not their sum (the sum was 40 % over on this model; now -3 %). The same
  band applies, and the estimate is checked to stay an upper bound there.
"""

from __future__ import annotations

import pytest
import torch
from helpers import write_recipe
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmft.data.tokenizer import load_tokenizer
from llmft.engines.single import SingleEngine
from llmft.job.dist import DistEnv
from llmft.plan.memory import estimate_memory
from llmft.plan.resolve import load_plan
from llmft.training.optim import build_optimizer

OVER_COUNT, UNDER_COUNT = 0.25, 0.10  # measured / estimate must lie in [1 - OVER_COUNT, 1 + UNDER_COUNT]


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created inside the mode and still alive, op by op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place ops return an input's storage: nothing new was allocated.
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs)) if _dense(t)}
        for t in tree_leaves(out):
            if _dense(t):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in inputs:
                    self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _dense(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def build(tmp_path, *overrides: str):
    micro = 4
    path = write_recipe(tmp_path, batch__micro_batch_size=micro, batch__global_batch_size=micro)
    plan = load_plan(str(path), list(overrides), world_size=1)
    recipe = plan.recipe
    engine = SingleEngine(
        plan,
        DistEnv(),
        load_tokenizer(recipe.model),
        lambda model: build_optimizer(model, recipe.optim, recipe.optim.lr),
    )
    seq = recipe.data.max_seq_len
    ids = torch.randint(0, 256, (micro, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    return recipe, engine, batch, estimate_memory(plan, micro)


def micro_step(engine, batch) -> None:
    """What llmft.training.loop does for one micro-batch (fp32 on CPU: autocast is a no-op)."""
    num_items = torch.tensor(float(batch["labels"][:, 1:].numel()))
    with engine.micro_step(True), engine.autocast():
        loss = engine.model(**batch, num_items_in_batch=num_items, use_cache=False).loss
    engine.backward(loss)


def test_weights_gradients_and_adamw_state_are_exact(tmp_path):
    recipe, engine, batch, est = build(tmp_path)
    params = list(engine.model.parameters())
    assert nbytes(params) == est.weights
    micro_step(engine, batch)
    assert nbytes(p.grad for p in params) == est.gradients
    engine.optimizer.step()
    state = engine.optimizer.state.values()
    assert nbytes(s[k] for s in state for k in ("exp_avg", "exp_avg_sq")) == est.optimizer
    assert nbytes(s["step"] for s in state) == 4 * len(params)  # left out of the estimate: 4 B per tensor
    assert est.adapters == est.master_weights == est.transient_weights == 0  # fp32, single, full fine-tune


CHECKPOINTING = ("model.attn_implementation=sdpa", "model.gradient_checkpointing=true")


def activation_peak(engine, batch) -> int:
    micro_step(engine, batch)  # gradients exist from here on, as on every micro-step after the first
    mode = PeakLiveBytes()
    with mode:
        micro_step(engine, batch)
    return mode.peak


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.attn_implementation=sdpa",),
        ("model.attn_implementation=eager",),
        CHECKPOINTING,
    ],
    ids=["sdpa", "eager", "sdpa-checkpointing"],
)
def test_activation_peak_within_tolerance(tmp_path, overrides):
    recipe, engine, batch, est = build(tmp_path, *overrides)
    peak = activation_peak(engine, batch)
    expected = est.activations + est.logits
    assert 1 - OVER_COUNT <= peak / expected <= 1 + UNDER_COUNT, (
        f"measured activation peak {peak:,} B, estimate {expected:,} B "
        f"(activations {est.activations:,} + logits {est.logits:,}), ratio {peak / expected:.3f}"
    )


def test_checkpointing_estimate_stays_an_upper_bound(tmp_path):
    recipe, engine, batch, est = build(tmp_path, *CHECKPOINTING)
    assert activation_peak(engine, batch) <= est.activations + est.logits
