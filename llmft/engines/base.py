"""What single, DDP and FSDP2 share: fp16 loss scaling, backward, clip + step, and the plain
(unsharded) checkpoint format single and DDP write."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

from llmft.checkpoint.layout import ADAPTER_WEIGHTS, MODEL_DIR, OPTIMIZER_FILE
from llmft.checkpoint.safe_load import torch_load
from llmft.engines import autocast_for
from llmft.job.dist import DistEnv
from llmft.model.adapters import is_peft
from llmft.model.build import prepare_model
from llmft.model.checkpoint_keys import to_model_keys
from llmft.model.precision import compute_dtype
from llmft.plan.layout import RunPlan


class LocalEngine:
    """An engine whose optimizer is a plain torch optimizer stepped in this process.

    Subclasses set ``model`` and ``optimizer``; they override ``micro_step`` / ``autocast``
    where they differ. Where the engine averages gradients over ranks (DDP's all-reduce, FSDP2's
    reduce-scatter), ``backward`` multiplies the loss by the number of data-parallel ranks first.
    """

    model: torch.nn.Module
    optimizer: Any

    def __init__(self, plan: RunPlan, env: DistEnv, tokenizer: Any = None) -> None:
        self.name = plan.engine
        self.plan, self.tokenizer = plan, tokenizer  # what ``frozen_model`` builds from
        self.env = env
        self.device = env.device
        self.dtype = compute_dtype(plan.recipe)
        self.peft = plan.peft
        self.max_grad_norm = plan.max_grad_norm
        # One process holds the whole batch and sums; DDP and FSDP2 average over every rank (with
        # sequence parallelism FSDP2 shards over the whole world: each rank's slice loss is its share).
        self._grad_scale = float(plan.layout.world_size) if plan.spec.multi_rank else 1.0
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    def micro_step(self, boundary: bool) -> ContextManager:
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        return autocast_for(self.dtype, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss * self._grad_scale
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        return clip_and_step(self.unwrap(), self.optimizer, self.scaler, self.max_grad_norm)

    def unwrap(self) -> torch.nn.Module:
        return self.model

    def place_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model its caller built whole (a reward model: ``objectives.rewards``), held as
        the engine holds the policy's weights: whole on this rank's device here (single, DDP);
        sharded by FSDP2 and ZeRO-3 (their own ``place_frozen``)."""
        return freeze(model.to(self.device))


# --- frozen models (Engine.frozen_model) ----------------------------------------------------------


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """A reference model: no gradients, no optimizer, eval mode."""
    model.requires_grad_(False)
    return model.eval()


class OneProcessModels:
    """A model in one process and the frozen models an objective asks of it (``objectives.Models``),
    for code that builds a model without an engine (``llmft verify``)."""

    def __init__(self, plan: RunPlan, model: torch.nn.Module, tokenizer: Any, device: torch.device) -> None:
        self.plan, self.model, self.tokenizer, self.device = plan, model, tokenizer, device

    def unwrap(self) -> torch.nn.Module:
        return self.model

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        return unsharded_frozen_model(plan, self.tokenizer, self.device, self.model)

    def place_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        return freeze(model.to(self.device))


def unsharded_frozen_model(
    plan: RunPlan | None, tokenizer: Any, device: torch.device, policy: torch.nn.Module
) -> torch.nn.Module:
    """Single and DDP (``Engine.frozen_model``): ``plan``'s model built whole like the policy, or
    with no plan a frozen copy of ``policy`` (asked before any step: its initial weights)."""
    if plan is None:
        return freeze(copy.deepcopy(policy))
    return freeze(prepare_model(plan, tokenizer, device))


def clip_and_step(model: torch.nn.Module, optimizer, scaler, max_grad_norm: float | None) -> float:
    """fp16: unscale once, before clipping. The norm is measured even when clipping is off."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = clip_grad_norm(params, max_grad_norm if max_grad_norm is not None else float("inf"))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters that may live on different device meshes (FSDP2's shards
    and expert-parallel experts, ``llmft.model.expert_parallel``): one global norm, from each mesh's
    norm reduced over its own ranks."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(groups) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP2
    norms = []
    for group in groups.values():
        grads = [p.grad for p in group if p.grad is not None]
        if grads:
            n = torch.nn.utils.get_total_norm(grads)
            norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


# --- the plain format: model/ (save_pretrained) + optimizer.pt ---------------------------------


def save_plain(model: torch.nn.Module, optimizer, directory: Path, *, save_optimizer: bool) -> None:
    """save_pretrained (PEFT adapter dir, or full HF model dir) + optimizer state; rank 0 only."""
    with quiet_save_pretrained():
        model.save_pretrained(directory / MODEL_DIR, safe_serialization=True)
    if save_optimizer:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)


@contextlib.contextmanager
def quiet_save_pretrained() -> Iterator[None]:
    """``save_pretrained`` of a single or DDP model, in a run: without DeepSpeed and without a
    progress bar (llmft logs the checkpoint itself).

    transformers unwraps the model through accelerate's ``extract_model_from_parallel``, which
    imports ``deepspeed`` (whenever it is installed) only to test ``isinstance(model,
    DeepSpeedEngine)``. A model these engines hold never is one, and the import costs seconds and
    prints DeepSpeed's "Setting accelerator to CPU" warning, so the availability check accelerate
    makes there answers no while the model is saved (unless DeepSpeed is already loaded). The
    "Writing model shards" bar is transformers' tqdm, muted through its hook for the same span."""
    from transformers.utils import logging as hf_logging

    restore: list[Callable[[], None]] = []
    if "deepspeed" not in sys.modules:
        with contextlib.suppress(ImportError):
            from accelerate.utils import other

            if hasattr(other, "is_deepspeed_available"):
                original = other.is_deepspeed_available
                other.is_deepspeed_available = lambda: False
                restore.append(lambda: setattr(other, "is_deepspeed_available", original))
    if hasattr(hf_logging, "set_tqdm_hook"):
        previous = getattr(hf_logging, "_tqdm_hook", None)
        hf_logging.set_tqdm_hook(lambda factory, args, kwargs: hf_logging.EmptyTqdm(*args, **kwargs))
        restore.append(lambda: hf_logging.set_tqdm_hook(previous))
    try:
        yield
    finally:
        for undo in restore:
            undo()


def load_plain(
    model: torch.nn.Module, optimizer, directory: Path, device: torch.device, *, load_optimizer: bool
) -> None:
    read_plain(model, directory)
    if load_optimizer:
        state = torch_load(directory / OPTIMIZER_FILE, map_location=device)  # weights_only (docs/design.md G7)
        optimizer.load_state_dict(state)


def read_plain(model: torch.nn.Module, step_dir: Path) -> None:
    """Inverse of save_pretrained into an already built model, without touching the base weights."""
    from safetensors.torch import load_file

    model_dir = Path(step_dir) / MODEL_DIR
    if is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(model_dir / ADAPTER_WEIGHTS))
        unexpected = getattr(result, "unexpected_keys", [])
        assert not unexpected, f"adapter checkpoint has unexpected keys: {unexpected[:5]}"
        return
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(model_dir / name))
    # save_pretrained writes a mixture of experts' fused experts one tensor per expert: back to the model's names
    missing, unexpected = model.load_state_dict(to_model_keys(model, state), strict=False)
    check_loaded_keys(model, missing, unexpected)


def check_loaded_keys(model: torch.nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """After a non-strict load of a whole model: no stray names, and only weights tied to another
    one (which save_pretrained and zero_to_fp32 drop) may be absent."""
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    assert not unexpected, f"checkpoint has unexpected keys: {unexpected[:5]}"
    assert set(missing) <= tied or all("lm_head" in k for k in missing), f"checkpoint misses {missing[:5]}"


def trainable_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}
