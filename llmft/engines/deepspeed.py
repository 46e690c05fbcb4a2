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
from llmft.engines.single import is_peft, prepare_model
from llmft.optim import build_optimizer, scaled_lr
from llmft.plan.batch import BatchPlan
from llmft.recipe.schema import Recipe

DS_DIR = "deepspeed"
# Fresh models (model.config) up to this size are built whole on every rank with the seeded init
# and partitioned by deepspeed.initialize, so their weights equal the single-process run's;
# larger ones and every pretrained model are built under zero.Init, partitioned from the start.
WHOLE_INIT_MAX_PARAMS = 1_000_000_000
TAG = "state"


def builds_whole(recipe: Recipe) -> bool:
    from llmft.plan.shape import model_shape

    shape = model_shape(recipe.model)
    return recipe.model.config is not None and shape is not None and shape.num_params <= WHOLE_INIT_MAX_PARAMS


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
        path, _ = self.model.load_checkpoint(
            str(directory / DS_DIR),
            tag=TAG,
            load_module_strict=not self.peft,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=False,
        )
        assert path is not None, f"DeepSpeed found no checkpoint in {directory / DS_DIR}"
