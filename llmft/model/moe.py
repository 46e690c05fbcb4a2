"""The router's load-balancing loss of a mixture-of-experts policy, over the whole global batch, as
an auxiliary term of the step (``llmft.model.aux_loss``); and the experts line of the banner.

The loss is the family's own in transformers (``load_balancing_loss_func``, the Switch Transformer
loss): over the non-padding tokens of the batch, every MoE layer's router logits concatenated,

    coef * E * sum_i f_i * P_i,   f_i = routed_i / (L * N),   P_i = sum_t p_ti / (L * N)

with E experts, L MoE layers, N tokens, ``routed_i`` the top-K assignments to expert i (no gradient)
and ``p_ti`` the router's softmax (with gradient). transformers computes it per forward, so under
accumulation or data parallelism it depends on the split. ``P`` is a sum over tokens, so each
micro-batch's share is ``coef * E * sum_i f_i * (sum of its tokens' p_ti) / (L * N)``: exact for any
split once the GLOBAL ``routed`` and ``N`` are known before the first backward. They come from a
routing pre-pass (``BalanceLoss.statistics``): a no-grad forward of the policy over the step's
micro-batches, logits of the last position only, under the RNG state the step's own forwards start
from; the sums ride on the step's one all-reduce of counts (every rank runs as many micro-batches,
so the collectives of FSDP2 and ZeRO-3 inside the pass match). ``moe.balance: micro_batch`` is
transformers' loss per micro-batch, averaged over the step's micro-batches and ranks, without the
pass. transformers' own addition of the loss to ``.loss`` is switched off on the policy (its
coefficient attribute set to 0): llmft adds it once, and logs it as ``aux/moe_balance``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

import torch

from llmft.data.arrays import TOKEN_MASK
from llmft.errors import UserError
from llmft.model.aux_loss import AuxLossBase, StepCounts, attach
from llmft.model.structure import human_count, logical_numel
from llmft.plan.moe import MoEFamily, family_problems, moe_family

log = logging.getLogger("llmft")

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")  # what the pre-pass hands the policy
TERM_NAME = "moe_balance"


def install(model: torch.nn.Module, moe: Any) -> BalanceLoss | None:
    """For an MoE ``model`` (the policy, PEFT-wrapped or not): transformers' own balancing loss off,
    and the balancing loss attached as an auxiliary term unless its coefficient is 0. ``moe``: the
    recipe's ``moe`` section. A dense model: nothing (the recipe check refuses ``moe.*`` for one)."""
    family = moe_family(model.config)
    if family is None:
        return None
    config = model.config
    problems = family_problems(family, moe)
    if problems:
        raise UserError(*problems)
    if family.aux_coef is None:  # routing balanced without a loss (deepseek_v3): transformers adds none either
        return None
    lm = _causal_lm(model, family)
    if lm is None:
        log.warning("moe: %s without its causal-LM head: no balancing loss is added", config.model_type)
        return None
    setattr(lm, family.coef_attr, 0.0)  # transformers would add it to .loss as well: llmft adds it once
    coef = moe.aux_loss_coef
    if coef is None:
        coef = float(getattr(config, family.aux_coef, 0.0) or 0.0) if family.aux_coef else 0.0
    if coef == 0:
        return None
    term = BalanceLoss(model, getattr(config, family.experts), getattr(config, family.top_k), coef, moe.balance)
    attach(model, term)
    return term


def _causal_lm(model: torch.nn.Module, family: MoEFamily) -> torch.nn.Module | None:
    """The module whose forward adds the balancing loss to ``.loss`` (inside a PEFT wrapper too)."""
    # Its own attribute (``vars``), not one a wrapper forwards (PEFT's ``PeftModel`` forwards every
    # unknown name to the model inside it: setting it there would leave transformers' loss on).
    return next((m for m in model.modules() if family.coef_attr in vars(m) and hasattr(m, "lm_head")), None)


def token_mask(batch: dict[str, Any]) -> torch.Tensor | None:
    """Which of a micro-batch's tokens are real: its attention mask, or where it has none (packed
    rows, sequence slices) its ``token_mask`` (``llmft.data.arrays.TOKEN_MASK``), or a packed pair's
    ``sequence_index``; None: every token."""
    mask = batch.get("attention_mask")
    if mask is None:
        mask = batch.get(TOKEN_MASK)
    if mask is None and "sequence_index" in batch:  # packed pairs: -1 on padding
        mask = (batch["sequence_index"] >= 0).long()
    return mask


def routing_sums(
    router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None, num_experts: int, top_k: int
) -> torch.Tensor:
    """``[N, routed (L x E, layer by layer), entropy]``, float64, no gradient: the batch's non-padding
    tokens, each layer's top-K assignments per expert as transformers counts them, and the sum over
    layers and tokens of the router's entropy (nats)."""
    device = router_logits[0].device
    flat = _flat_mask(mask, router_logits[0].shape[0], device)
    routed, entropy = [], torch.zeros((), dtype=torch.float64, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.detach(), dim=-1)  # in the logits' dtype, as transformers does
        _, chosen = torch.topk(probs, top_k, dim=-1)
        counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
        routed.append(counts.scatter_add_(0, chosen.reshape(-1), flat.double().repeat_interleave(top_k)))
        entropy = entropy + (torch.special.entr(probs.double()).sum(-1) * flat).sum()
    return torch.cat([flat.double().sum().reshape(1), *routed, entropy.reshape(1)])


def balancing_loss(router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None, num_experts: int, top_k: int):
    """transformers' ``load_balancing_loss_func`` on one forward's router logits (``moe.balance: micro_batch``)."""
    stats = routing_sums(router_logits, mask, num_experts, top_k)
    return _loss_with(stats, router_logits, mask, num_experts)


def _loss_with(
    stats: torch.Tensor, router_logits: Sequence[torch.Tensor], mask: torch.Tensor | None, num_experts: int
) -> torch.Tensor:
    """E * sum_i f_i * P_i with ``f`` (and N) from ``stats`` (``routing_sums``' layout, of the global
    batch or of this forward) and ``P``'s sum over this forward's tokens."""
    layers = len(router_logits)
    rows = layers * stats[0].float()  # transformers' total_rows: every layer's tokens
    routed = stats[1 : 1 + layers * num_experts].float().view(layers, num_experts).sum(0)
    flat = _flat_mask(mask, router_logits[0].shape[0], router_logits[0].device)
    probs = sum((torch.softmax(g, dim=-1).float() * flat.unsqueeze(-1)).sum(0) for g in router_logits)
    return num_experts * ((routed / rows) * (probs / rows)).sum()


def _flat_mask(mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """One weight per router row: the attention mask flattened as the rows are; none: every row."""
    if mask is None:
        return torch.ones(rows, dtype=torch.float32, device=device)
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


class BalanceLoss(AuxLossBase):
    """The router's load-balancing loss: over the global batch (``global_batch``) or per micro-batch."""

    name = TERM_NAME
    forward_kwargs = {"output_router_logits": True}

    def __init__(self, policy: torch.nn.Module, num_experts: int, top_k: int, coef: float, balance: str) -> None:
        self._policy = weakref.ref(policy)  # the term is held by a table keyed weakly by the policy
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.global_batch = balance == "global_batch"

    def statistics(self, micro_batches: list[dict[str, Any]]) -> list[float]:
        if not self.global_batch:
            return [float(len(micro_batches))]  # the step's micro-batches: the loss is their mean
        return self.routing_pass(micro_batches).tolist()

    def routing_pass(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """``routing_sums`` over this rank's micro-batches: a no-grad forward of the policy each."""
        policy = self._policy()
        assert policy is not None, "the policy of a balancing loss is gone"
        sums = None
        cuda = torch.cuda.is_available()  # the training device: the one the process set (init_distributed)
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # The step's forwards then draw what this pass drew (dropout, router jitter): the same routing.
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if cuda else []):
            for mb in micro_batches:
                inputs = {k: mb[k].to(device) for k in INPUT_KEYS if mb.get(k) is not None}
                out = policy(**inputs, use_cache=False, output_router_logits=True, logits_to_keep=1)
                mask = token_mask(mb)
                mask = mask.to(device) if mask is not None else None
                part = routing_sums(out.router_logits, mask, self.num_experts, self.top_k)
                sums = part if sums is None else sums + part
        assert sums is not None, "a step without micro-batches"
        return sums

    def term(self, output: Any, batch: dict[str, Any], counts: StepCounts) -> torch.Tensor:
        logits, mask = output.router_logits, token_mask(batch)
        if not self.global_batch:
            return self.coef * balancing_loss(logits, mask, self.num_experts, self.top_k) / counts.statistics[0]
        return self.coef * _loss_with(counts.statistics, logits, mask, self.num_experts)

    def metrics(self, statistics: torch.Tensor) -> dict[str, float]:
        """Expert load of the global batch: max / mean tokens per expert (the worst layer's and the mean
        over layers) and the router's mean entropy per token and layer (nats)."""
        if not self.global_batch:
            return {}
        routed = statistics[1:-1].double().view(-1, self.num_experts)
        ratio = routed.max(1).values / routed.mean(1).clamp_min(1e-12)
        rows = routed.shape[0] * float(statistics[0])
        return {
            "moe/load_max_over_mean": float(ratio.max()),
            "moe/load_max_over_mean_avg": float(ratio.mean()),
            "moe/router_entropy": float(statistics[-1]) / max(rows, 1.0),
        }


def experts_line(model: torch.nn.Module) -> str | None:
    """``experts 8, active 2 per token, parameters 1.2B total / 0.4B active`` for an MoE model; the
    routed experts' weights (``...experts...``) count K / E of theirs as active."""
    config = getattr(model, "config", None)  # a model of a test, or of no transformers family: none
    if config is None:
        return None
    try:
        family = moe_family(config)
    except UserError:
        return None
    if family is None:
        return None
    num_experts, top_k = getattr(model.config, family.experts), getattr(model.config, family.top_k)
    total = expert = 0
    for name, p in model.named_parameters():
        n = logical_numel(p)
        total += n
        expert += n if ".experts." in f".{name}." else 0
    active = total - expert + expert * top_k // num_experts
    return f"experts {num_experts}, active {top_k} per token, parameters {human_count(total)} total / {human_count(active)} active"
