"""Expert parallelism (``distributed.expert_parallel: N``, FSDP2): every MoE layer's routed experts
split over the N innermost ranks of the shard dimension, E / N whole experts on each, tokens
dispatched to them all-to-all (torchtitan's layout; ``llmft.plan.dims.EXPERT``).

Each fused expert weight of transformers 5 (``experts.gate_up_proj`` ``[E, ., .]``, ``down_proj``,
gpt-oss's biases: every parameter of the experts module, experts first) becomes a DTensor sharded
on dimension 0 over the expert group (mesh dimension ``ep``): its local tensor is this rank's
experts, and DCP saves, loads and reshards it like any FSDP2 shard. FSDP2 leaves these parameters
alone (``ignored_params``); the ranks that hold the same experts (one in each expert group: mesh
dimension ``ep_replicate``) hold them whole and sum their gradients once per optimizer step
(``ExpertShards.reduce_gradients``).

The experts module's forward, for a micro-batch's tokens and their top-K routing:

1. the (token, expert) assignments sorted by expert, so by the rank that holds it; counts exchanged;
2. the assigned rows sent all-to-all (with autograd: the backward returns their gradients);
3. the module's own forward (transformers' loop or grouped matmul) on the rows received, with the
   local experts and unit routing weights;
4. the results sent back all-to-all and added up per token with the routing weights, as
   transformers adds them.

Every rank calls both all-to-alls in every forward and, under autograd, in every backward (a rank
that receives no rows still joins: its result is tied to its inputs and weights), so ranks whose
tokens route to different experts never wait on each other. Gradients: each token's contribution
to an expert's weights arrives on the rank that holds it, so the expert group's sum is already
there; FSDP2's reduce-scatter averages the other parameters over the data-parallel ranks after the
loss was multiplied by their number (``LocalEngine.backward``), and the experts' gradients are
divided by the same number.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils.stateless import _reparametrize_module

from llmft.errors import Problem, UserError
from llmft.job.dist import mesh_view
from llmft.plan.moe import MoEFamily, expert_parallel_model_problems, moe_family

log = logging.getLogger("llmft")

EP_DIM, REPLICA_DIM = "ep", "ep_replicate"


@dataclass
class ExpertShards:
    """The expert-parallel parameters of a model and the groups they live on."""

    params: set[torch.nn.Parameter]  # every experts module's parameters: FSDP2's ignored_params
    replicas: Any  # the group of ranks holding the same experts (None: one rank each)

    def reduce_gradients(self, scale: float) -> None:
        """Once per optimizer step, before clipping: sum each expert's gradient over the ranks that
        hold it and divide by ``scale`` (the data-parallel size the loss was multiplied by)."""
        for p in self.params:
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.replicas is not None:
                dist.all_reduce(local, group=self.replicas)
            local.div_(scale)


def expert_mesh(device_type: str, layout: Any):
    """The world as ``(ep_replicate, ep)``: consecutive ranks form an expert group (the innermost
    ranks of ``shard``, the layout's ``ep``), and the ranks at the same place in every group hold
    the same experts."""
    n = layout.size(EP_DIM)
    return mesh_view(device_type, ((REPLICA_DIM, layout.world_size // n), (EP_DIM, n)))


def install(model: torch.nn.Module, n: int, mesh: Any, peft: Any = None) -> ExpertShards:
    """Split every MoE layer's experts of ``model`` over ``mesh[EP_DIM]`` (``n`` ranks); ``mesh``
    from ``expert_mesh``. Parameters on the meta device stay there (``llmft.model.meta`` fills the
    local shards). Refuses a model whose experts cannot be split, naming why."""
    config = getattr(model, "config", None)
    family = moe_family(config) if config is not None else None
    problems = expert_parallel_model_problems(family, config, peft, n) if config is not None else []
    if config is None or family is None:
        problems = problems or [_not_moe(model)]
    if problems:
        raise UserError(*problems)
    num_experts = getattr(config, family.experts)
    modules = experts_modules(model, family, num_experts)
    group_mesh = mesh[EP_DIM]
    rank, local = group_mesh.get_local_rank(), num_experts // n
    params: set[torch.nn.Parameter] = set()
    for module in modules:
        for attr, p in list(module._parameters.items()):
            piece = p.detach()[rank * local : (rank + 1) * local]
            if p.device.type != "meta":
                piece = piece.clone()
            shard = DTensor.from_local(piece, group_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            module._parameters[attr] = torch.nn.Parameter(shard, requires_grad=p.requires_grad)
            params.add(module._parameters[attr])
        module.num_experts = local  # the module's own forward loops over its local experts
        module._llmft_ep = (group_mesh.get_group(), n, local)
        module.forward = _dispatching_forward(module)
    replicas = mesh[REPLICA_DIM].get_group() if mesh[REPLICA_DIM].size() > 1 else None
    log.info(
        "expert parallel: experts %d-%d of %d on this rank in each of %d MoE layers, tokens all-to-all over %d ranks",
        rank * local,
        (rank + 1) * local - 1,
        num_experts,
        len(modules),
        n,
    )
    return ExpertShards(params=params, replicas=replicas)


def experts_modules(model: torch.nn.Module, family: MoEFamily, num_experts: int) -> list[torch.nn.Module]:
    """The modules holding the family's fused expert weights; each must take transformers'
    ``(hidden_states, top_k_index, top_k_weights)`` and hold only ``[E, ...]`` parameters."""
    found = []
    for name, module in model.named_modules():
        own = [f"{name}.{attr}" for attr in module._parameters]
        if not any(full.endswith(w) for full in own for w in family.expert_weights):
            continue
        shapes = {attr: tuple(p.shape) for attr, p in module._parameters.items() if p is not None}
        takes = len(inspect.signature(type(module).forward).parameters) == 4  # self + the three
        if not takes or any(not s or s[0] != num_experts for s in shapes.values()):
            raise UserError(
                Problem(
                    "distributed.expert_parallel",
                    f"the experts of {family.model_type} ({name}: {type(module).__name__}, parameters {shapes}) are "
                    "not transformers' fused layout (a forward of hidden states, top-k indices and weights over "
                    f"[{num_experts}, ...] parameters), so they cannot be split over ranks",
                    "Set distributed.expert_parallel=1.",
                )
            )
        found.append(module)
    if not found:
        raise UserError(_not_moe(model))
    return found


def _not_moe(model: torch.nn.Module) -> Problem:
    config = getattr(model, "config", None)
    return Problem(
        "distributed.expert_parallel",
        f"is set, but the model ({getattr(config, 'model_type', type(model).__name__)!r}) has no fused experts "
        "llmft knows how to place on ranks",
        "Set distributed.expert_parallel=1 (docs/moe.md lists the families).",
    )


def _dispatching_forward(module: torch.nn.Module):
    own_forward = type(module).forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group, n, local = module._llmft_ep
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by the rank holding it
        expert = flat[order]
        send = torch.bincount(torch.div(expert, local, rounding_mode="floor"), minlength=n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        ids = torch.empty(sum(recv_sizes), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(ids, expert % local, recv_sizes, send_sizes, group=group)
        tokens = torch.div(order, top_k, rounding_mode="floor")
        rows = all_to_all_single_autograd(hidden_states[tokens], recv_sizes, send_sizes, group)
        weights = {attr: p.to_local().to(hidden_states.dtype) for attr, p in module._parameters.items()}
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        with _reparametrize_module(module, weights):
            out = own_forward(module, rows, ids.unsqueeze(1), ones)
        # Tied to every input of the exchange: a rank with no rows still takes part in the backward.
        out = out + 0 * (rows.sum() + sum(w.reshape(-1)[:1].sum() for w in weights.values()))
        back = all_to_all_single_autograd(out, send_sizes, recv_sizes, group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        result = torch.zeros_like(hidden_states)
        return result.index_add(0, tokens, weighted.to(hidden_states.dtype))

    return forward
