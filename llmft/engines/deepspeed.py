"""DeepSpeed ZeRO 0-3 with the ds_config compiled from the recipe.

The loop's loss is already normalised by the global token count, so DeepSpeed is
told not to divide by accumulation steps (``scale_wrt_gas=False``) and the mean
over ranks is undone by ``grad_scale``. Clipping happens inside DeepSpeed's step
(``gradient_clipping`` in the config). ZeRO-3 models are built under
``zero.Init`` (via ``HfDeepSpeedConfig``) so no rank materialises the whole model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager

import torch

from llmft.dist import DistEnv
from llmft.engines import builds_whole
from llmft.engines.single import is_peft, prepare_model
from llmft.optim import build_optimizer, scaled_lr
from llmft.plan.batch import BatchPlan
from llmft.recipe.schema import Recipe

DS_DIR = "deepspeed"
TAG = "state"


class DeepSpeedEngineAdapter:
    name = "deepspeed"

    def __init__(self, recipe: Recipe, env: DistEnv, plan: BatchPlan, tokenizer, total_steps: int) -> None:
        import deepspeed

        from llmft.plan.deepspeed import deepspeed_config
        from llmft.plan.shape import model_shape

        self.env = env
        # DeepSpeed's comm layer wraps the process group train.py created; its config checks
        # (batch x world size, also inside zero.Init) read the world size from there.
        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo", auto_mpi_discovery=False
        )
        self.config = deepspeed_config(recipe, model_shape(recipe.model))
        self._hf_ds = None
        if recipe.distributed.zero_stage == 3 and not builds_whole(recipe):
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds = HfDeepSpeedConfig(self.config)  # must stay alive while the model is built
        model = prepare_model(recipe, tokenizer, env.device)
        self.peft = is_peft(model)
        self.optimizer = build_optimizer(model, recipe.optim, scaled_lr(recipe.optim, plan.global_batch_size))
        self.model, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.config)
        # DeepSpeed averages gradients over data-parallel ranks.
        self.grad_scale = float(env.world_size)

    def micro_step(self, boundary: bool) -> ContextManager:
        self.model.set_gradient_accumulation_boundary(boundary)
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()  # DeepSpeed runs the module in its bf16/fp16 dtype

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm: float | None) -> float:
        self.model.step()  # the boundary was set on the last micro-step: clip + optimizer step + zero grad
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def unwrap(self) -> torch.nn.Module:
        return self.model.module

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        # UNIVERSAL_CHECKPOINT_INFO in client_state is what lets ds_to_universal convert this
        # checkpoint later for a resume on another world size.
        self.model.save_checkpoint(
            str(directory / DS_DIR),
            tag=TAG,
            client_state={UNIVERSAL_CHECKPOINT_INFO: {}},
            save_latest=False,
            exclude_frozen_parameters=self.peft,
        )

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        from llmft.checkpoint import deepspeed_dp_size, universal_for_resume

        # ZeRO 1-3 state is partitioned per data-parallel rank; on another world size DeepSpeed
        # only loads its universal format, converted here on first use (rank 0, others wait).
        saved_dp = deepspeed_dp_size(directory)
        elastic = saved_dp is not None and saved_dp != self.env.world_size
        load_dir = universal_for_resume(directory, self.env) if elastic else directory / DS_DIR
        # The same switch as `"checkpoint": {"load_universal": true}` in the config: the engine
        # reads it at load time (DeepSpeedEngine.load_universal_checkpoint()), and only this load
        # needs it, so it is set here rather than in the config every run starts with.
        self.model._config.load_universal_checkpoint = elastic
        repair = elastic and load_optimizer and self.model.zero_optimization_stage() == 3
        if repair:
            optimizer = self.model.optimizer.optimizer  # the torch optimizer inside ZeRO-3's wrapper
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            path, _ = self.model.load_checkpoint(
                str(load_dir),
                tag=TAG,
                load_module_strict=not self.peft,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=False,
            )
        finally:
            self.model._config.load_universal_checkpoint = False
        assert path is not None, f"DeepSpeed found no checkpoint in {load_dir}"
        if repair:
            _repair_zero3_universal_load(optimizer, groups)


def _repair_zero3_universal_load(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19, ``stage3.py``
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``; stages 1-2 load per group).

    - Every param group gets the same ``step`` tensor, which each group's Adam update then
      advances in place: with decay and no-decay groups the bias correction counts two
      steps per step from the first step after the resume.
    - Every param group gets group 0's hyperparameters: the decay group's weight decay
      lands on norms and biases.

    ``groups`` are the hyperparameters the recipe built the optimizer with; the learning
    rate is the one loaded (one schedule drives every group).
    """
    for group, built in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in built.items() if k != "lr"})
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
