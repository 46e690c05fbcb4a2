"""PyTorch FSDP2: ``fully_shard`` per decoder layer and the root (on a CPU run, whose gathered
weights are host memory, also per attention, MLP, input embedding and LM head, without backward
prefetch: one of them gathered at a time), gradients reduce-scattered once
per optimizer step (``set_requires_gradient_sync(False)`` on the other micro-steps), or, with
``distributed.fsdp_grad_sync: micro_step``, every micro-step (sharded gradients while
accumulating), DCP checkpoints that reshard to any world size.

The sharding comes from the run's FSDP2 plan (``llmft.plan.fsdp.fsdp_plan``: mesh, mixed
precision, offload, resharding), the same one ``llmft compile`` writes to ``fsdp.yaml``.

Big models stay sharded (docs/design.md): a pretrained model, or a fresh one too big to build
whole, is built on the meta device and each rank materialises only its shards
(``llmft.model.meta``). Small fresh models are built whole on every rank with the seeded
init, as on every engine, so their weights equal the single-process run's. A pretrained 4-bit
(QLoRA) base is built on the meta device too, in its packed layout, and each rank quantizes the
weights one at a time and keeps its part of the packed bytes (``llmft.model.quant_shard``); a fresh quantized
``model.config`` model is built whole and frees all but its shards once ``fully_shard`` has run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from llmft.checkpoint.layout import DCP_DIR
from llmft.engines import OptimizerFactory, safe_dcp
from llmft.engines.base import LocalEngine, freeze, trainable_names
from llmft.job.dist import DistEnv, param_mesh, sequence_group
from llmft.model import expert_parallel, ulysses
from llmft.model.build import prepare_model
from llmft.model.meta import ParamSlots, SafetensorsWeights, build_on_meta, materialize
from llmft.model.precision import DTYPES
from llmft.model.structure import decoder_layer_classes
from llmft.plan.fsdp import fsdp_plan
from llmft.plan.layout import RunPlan


class FSDPEngine(LocalEngine):
    def __init__(self, plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> None:
        super().__init__(plan, env, tokenizer)
        # The reduce-scatter averages over all data-parallel ranks (shard x replicate): backward undoes it.
        sharding = fsdp_plan(plan)
        self.sync_every_micro_step = plan.recipe.distributed.fsdp_grad_sync == "micro_step"
        self.mesh = param_mesh(self.device.type, plan.layout)  # the layout's, a view of the world mesh
        self.sharding = sharding
        self.model, self.experts = self._build_sharded(plan, tokenizer)
        self.optimizer = make_optimizer(self.model)

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        """Built and sharded exactly like the policy (a copy: the policy's plan built again, its
        initial weights): every rank holds only its shards, and a forward gathers them layer by layer."""
        return freeze(self._build_sharded(plan or self.plan, self.tokenizer)[0])

    def place_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model its caller built whole on the CPU (a reward model: ``objectives.rewards``),
        sharded as the policy is (each decoder layer and the root a unit, the policy's mixed
        precision and offload): every rank keeps only its shards, gathered layer by layer in a forward
        that every rank runs together."""
        kwargs = self._shard_kwargs()
        reshard, layer_classes = self.sharding.reshard_after_forward, decoder_layer_classes(model)
        for module in model.modules():
            if isinstance(module, layer_classes):
                fully_shard(module, reshard_after_forward=reshard, **kwargs)
        fully_shard(model, reshard_after_forward=False, **kwargs)
        if not self.sharding.cpu_offload:
            model.to(self.device)
        return freeze(model)

    def _shard_kwargs(self) -> dict[str, Any]:
        """``fully_shard``'s mesh, mixed precision and offload, the same for every model of the run."""
        precision = self.sharding.mixed_precision
        mp = MixedPrecisionPolicy(
            param_dtype=None if self.dtype == torch.float32 else DTYPES[precision.param_dtype],
            reduce_dtype=DTYPES[precision.reduce_dtype],
        )
        # Pinned host memory speeds up the copies to an accelerator; without one there is none to pin.
        pin = self.device.type != "cpu"
        offload = CPUOffloadPolicy(pin_memory=pin) if self.sharding.cpu_offload else OffloadPolicy()
        return dict(mesh=self.mesh, mp_policy=mp, offload_policy=offload)

    def _build_sharded(
        self, plan: RunPlan, tokenizer: Any
    ) -> tuple[torch.nn.Module, expert_parallel.ExpertShards | None]:
        """The plan's model, ``fully_shard``-ed per decoder layer and at the root, its shards placed;
        with expert parallelism its experts split over the expert group first (FSDP2 leaves them)."""

        sharding = self.sharding
        slots = weights = None
        if plan.meta_init:
            model, slots, weights = build_on_meta(plan, tokenizer)
        else:
            # Every rank builds the same (seeded) model on CPU, then keeps only its shards.
            model = prepare_model(plan, tokenizer, torch.device("cpu"))
        kwargs = self._shard_kwargs()
        if plan.sequence_parallel > 1:
            ulysses.install(model, sequence_group(plan.layout.mesh))
        experts = None
        if plan.layout.size(expert_parallel.EP_DIM) > 1:
            mesh = expert_parallel.expert_mesh(self.device.type, plan.layout)
            experts = expert_parallel.install(model, plan.layout.size(expert_parallel.EP_DIM), mesh, plan.recipe.peft)
            kwargs["ignored_params"] = experts.params
        layer_classes = decoder_layer_classes(model)
        host = self.device.type == "cpu"  # the gathered weights are host memory: one unit at a time
        for module in model.modules():
            if isinstance(module, layer_classes):
                for part in layer_parts(module) if host else []:
                    fully_shard(part, reshard_after_forward=sharding.reshard_after_forward, **kwargs)
                fully_shard(module, reshard_after_forward=sharding.reshard_after_forward, **kwargs)
        # On a CPU run a frozen embedding or head the weight file holds in the run's dtype is not
        # sharded: every rank maps it whole from the file (page cache, shared), nothing to gather.
        whole = mapped_vocab(model, slots, weights) if host and plan.meta_init and not sharding.cpu_offload else set()
        for module, reshard in vocab_units(model) if host else []:
            if module.weight not in whole:
                fully_shard(module, reshard_after_forward=reshard, **kwargs)
        # the root is needed right away in backward
        kwargs["ignored_params"] = whole | kwargs.get("ignored_params", set()) or None
        fully_shard(model, reshard_after_forward=False, **kwargs)
        if host:
            no_backward_prefetch(model)
        # generate() on the root (a PEFT model's too) gathers the root's own parameters (embedding,
        # norm, head) as its forward does; the layers gather theirs in their forward
        if callable(getattr(model, "generate", None)):  # a causal LM (a score head generates nothing)
            register_fsdp_forward_method(model, "generate")
        if plan.meta_init:
            shards_on = torch.device("cpu") if sharding.cpu_offload else self.device
            materialize(model, slots, weights, seed=plan.recipe.run.seed, device=self.device, shards_on=shards_on)
        elif not sharding.cpu_offload:
            model.to(self.device)
        return model, experts

    def micro_step(self, boundary: bool) -> ContextManager:
        # boundary: unsharded gradients accumulate locally and are reduce-scattered once, on the
        # last micro-step; micro_step: every backward reduce-scatters and FSDP2 adds the result
        # into the sharded gradient, so only a shard is ever kept between micro-steps.
        self.model.set_requires_gradient_sync(boundary or self.sync_every_micro_step)
        if boundary and self.experts is not None:
            return self._experts_reduced()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _experts_reduced(self) -> Iterator[None]:
        """After the step's last backward, as FSDP2's reduce-scatter: the experts' gradients summed
        over the ranks holding the same experts, divided as FSDP2 divides the others."""
        yield
        self.experts.reduce_gradients(self._grad_scale)

    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts inside the sharded modules

    def _options(self) -> StateDictOptions:
        # Adapters: the frozen base is rebuilt from the recipe, only trainable weights are saved.
        return StateDictOptions(ignore_frozen_params=self.peft, strict=not self.peft)

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        state = {"model": model_sd, "optim": optim_sd} if save_optimizer else {"model": model_sd}
        dcp.save(state, checkpoint_id=str(directory / DCP_DIR))

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        state = {"model": model_sd, "optim": optim_sd} if load_optimizer else {"model": model_sd}
        safe_dcp.load(state, directory / DCP_DIR)  # G7 (docs/design.md): restricted unpickling (llmft.engines.safe_dcp)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}) if load_optimizer else {},
            options=self._options(),
        )


def layer_parts(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A decoder layer's attention and MLP (its children holding a quarter of its parameters or
    more), each its own unit on a CPU run: a step's host memory then holds one of them gathered
    at a time, not the whole layer (the layer's own unit keeps its norms). Not inside a compiled
    layer, whose graph FSDP2's hooks on a submodule would break."""
    if getattr(layer, "_compiled_call_impl", None) is not None:
        return []
    total = sum(p.numel() for p in layer.parameters())
    return [c for c in layer.children() if 4 * sum(p.numel() for p in c.parameters()) >= total]


def _embedding_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The model's input embedding and LM head modules (None where it has none: a score model's head)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    return (get_in() if get_in else None), (get_out() if get_out else None)


def vocab_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """The input embedding and the LM head, each its own unit on a CPU run, with whether it is
    resharded after forward: the embedding is (its backward needs no weight: the embedding is
    frozen or its gradient is a sparse scatter computed from the gathered weight's shape), the
    head is not (its backward comes first). Neither when they share a weight (tied)."""
    embed, head = _embedding_and_head(model)
    units = []
    if embed is not None and not (head is not None and getattr(head, "weight", None) is embed.weight):
        units.append((embed, True))
        if head is not None:
            units.append((head, False))
    return units


def mapped_vocab(
    model: torch.nn.Module, slots: ParamSlots, weights: SafetensorsWeights | None
) -> set[torch.nn.Parameter]:
    """The input embedding and LM head weights that are frozen and stored in the weight files in
    the dtype the model uses (``SafetensorsWeights.can_map``): on a CPU run every rank maps them
    whole (``llmft.model.meta.materialize``) and FSDP2 leaves them alone."""
    if weights is None:
        return set()
    candidates = [m._parameters.get("weight") for m in _embedding_and_head(model) if m is not None]
    by_key = slots.by_key()
    keys = {id(slots.param(name)): (key, name) for key, names in by_key.items() for name in names}
    whole = set()
    for p in candidates:
        if p is None or p.requires_grad or id(p) not in keys:
            continue
        key, name = keys[id(p)]
        if key not in weights.fresh and weights.can_map(key, p.shape, slots.dtype[name]):
            whole.add(p)
    return whole


def no_backward_prefetch(model: torch.nn.Module) -> None:
    """Each unit gathers only itself in backward. By default a unit's backward also gathers the
    next one; with an accelerator that all-gather overlaps compute, on a CPU (gloo, no streams)
    it runs at once, so it only holds a second unit gathered (and its all-gather buffer). Asking
    a unit to prefetch itself replaces the default, and is a no-op: it is already gathered."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_modules_to_backward_prefetch([module])


def read_dcp(model: torch.nn.Module, step_dir: Path) -> None:
    """The model part of an FSDP2 checkpoint into an unsharded model, without a process group:
    DCP reshards to one process. Adapter runs saved only the trainable weights."""
    state = model.state_dict()
    if hasattr(model, "peft_config"):
        keep = trainable_names(model)
        state = {k: v for k, v in state.items() if k in keep}
    missing, unexpected = model.load_state_dict(dcp_reader(step_dir)(state), strict=False)
    assert not unexpected, unexpected[:5]


def dcp_reader(step_dir: Path):
    """A function ``{name: empty tensor} -> the same dict filled`` from an FSDP2 checkpoint's model
    part, without a process group: DCP reads only the keys asked for (export streams a full
    fine-tune this way, a group of weights at a time, never the whole model)."""

    def read(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        holder = {"model": tensors}
        safe_dcp.load(holder, Path(step_dir) / DCP_DIR, no_dist=True)  # restricted unpickling, as every DCP load
        return holder["model"]

    return read
