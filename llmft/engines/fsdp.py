"""PyTorch FSDP2: ``fully_shard`` per decoder layer and the root, gradients reduce-scattered once
per optimizer step (``set_requires_gradient_sync(False)`` on the other micro-steps), DCP checkpoints
that reshard to any world size."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from llmft.dist import DistEnv
from llmft.engines.single import DTYPES, clip_and_step, compute_dtype, is_peft, prepare_model
from llmft.optim import build_optimizer, scaled_lr
from llmft.plan.batch import BatchPlan
from llmft.recipe.schema import Recipe

DCP_DIR = "dcp"


class FSDPEngine:
    name = "fsdp"

    def __init__(self, recipe: Recipe, env: DistEnv, plan: BatchPlan, tokenizer, total_steps: int) -> None:
        from llmft.model import decoder_layer_classes

        d = recipe.distributed
        self.env = env
        self.device = env.device
        self.dtype = compute_dtype(recipe)
        # The reduce-scatter averages over all data-parallel ranks (shard x replicate).
        self.grad_scale = float(env.world_size)
        self.mesh = (
            init_device_mesh(
                self.device.type,
                (d.hsdp_replicate, env.world_size // d.hsdp_replicate),
                mesh_dim_names=("replicate", "shard"),
            )
            if d.hsdp_replicate > 1
            else init_device_mesh(self.device.type, (env.world_size,), mesh_dim_names=("shard",))
        )
        # Every rank builds the same (seeded) model on CPU, then keeps only its shards.
        model = prepare_model(recipe, tokenizer, torch.device("cpu"), shard_quant_storage=True)
        mp = MixedPrecisionPolicy(
            param_dtype=None if self.dtype == torch.float32 else self.dtype,
            reduce_dtype=DTYPES[d.reduce_dtype],
        )
        offload = CPUOffloadPolicy() if d.offload_params == "cpu" else OffloadPolicy()
        kwargs = dict(mesh=self.mesh, mp_policy=mp, offload_policy=offload)
        layer_classes = decoder_layer_classes(model)
        for module in model.modules():
            if isinstance(module, layer_classes):
                fully_shard(module, reshard_after_forward=d.reshard_after_forward, **kwargs)
        fully_shard(model, reshard_after_forward=False, **kwargs)  # the root is needed right away in backward
        if d.offload_params != "cpu":
            model.to(self.device)
        self.model = model
        self.peft = is_peft(model)
        self.optimizer = build_optimizer(model, recipe.optim, scaled_lr(recipe.optim, plan.global_batch_size))
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    def micro_step(self, boundary: bool) -> ContextManager:
        self.model.set_requires_gradient_sync(boundary)
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts inside the sharded modules

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm: float | None) -> float:
        return clip_and_step(self.model, self.optimizer, self.scaler, max_grad_norm)

    def unwrap(self) -> torch.nn.Module:
        return self.model

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
        dcp.load(state, checkpoint_id=str(directory / DCP_DIR))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}) if load_optimizer else {},
            options=self._options(),
        )
