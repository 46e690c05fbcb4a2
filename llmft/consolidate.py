"""Turn any engine's checkpoint back into one ordinary (unsharded) model in one process.

single / ddp: ``model/`` is a save_pretrained dir. fsdp: a DCP folder, read without a
process group, resharded to one process by DCP. deepspeed: ZeRO 1-3 partitions, merged to
fp32 by DeepSpeed's own ``zero_to_fp32``; ZeRO-0's whole module state, read with
``weights_only``. Export and the cross-engine tests use this.

DeepSpeed checkpoints are DeepSpeed's format: its ``*_model_states.pt`` and
``*_optim_states.pt`` files are Python pickles that only ``torch.load(weights_only=False)``
reads. They are the one exception to "nothing is unpickled" (SPEC 8): llmft never opens them
itself, and lets DeepSpeed's own code read the files a DeepSpeed run wrote (here, the engine's
``load_checkpoint`` on resume, and ``ds_to_universal`` for an elastic resume). Load DeepSpeed
checkpoints only from runs you trust; every other engine's state is safetensors, DCP or
``weights_only`` files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmft.checkpoint import STATE_FILE, deepspeed_dp_size, resolve_checkpoint
from llmft.recipe import Recipe, load_recipe


def checkpoint_engine(ckpt: Path) -> str:
    return json.loads((ckpt / STATE_FILE).read_text())["engine"]


def load_checkpoint_model(
    path: str | Path, *, adapter_only: bool = False
) -> tuple[torch.nn.Module, object, Recipe, Path]:
    """(model in fp32 on CPU with the checkpoint's weights, tokenizer, recipe, checkpoint dir).

    ``adapter_only`` (for a PEFT run): the frozen base stays on the meta device and only the
    adapter gets memory, which is all a sharded PEFT checkpoint holds and all an adapter
    export needs (a 70B base would otherwise take 280 GB of RAM in fp32 to write a few MB).
    """
    from llmft.engines.single import MODEL_DIR, load_model_weights
    from llmft.model import build_model
    from llmft.tokenizer import load_tokenizer

    ckpt = resolve_checkpoint(path)
    recipe = load_recipe(
        ckpt / "recipe.yaml",
        [
            "distributed.engine=single",
            "distributed.nnodes=1",
            "distributed.nproc_per_node=1",
            "distributed.hsdp_replicate=1",
            "distributed.offload_optimizer=none",
            "distributed.offload_params=none",
            "batch.gradient_accumulation_steps=auto",
        ],
        world_size=1,
    )
    recipe.model.quantization = None  # export and comparisons want plain weights
    recipe.model.dtype = "fp32"
    recipe.model.gradient_checkpointing = False
    tok_dir = ckpt / "tokenizer"
    tokenizer = load_tokenizer(recipe.model) if not tok_dir.is_dir() else _load_tok(tok_dir)
    engine = checkpoint_engine(ckpt)
    if adapter_only and recipe.peft.method != "none" and engine in ("fsdp", "deepspeed"):
        model = build_model(recipe, tokenizer, init_context=lambda: torch.device("meta"))
        _materialize_trainable(model)
    else:
        model = build_model(recipe, tokenizer, device="cpu")
    if engine in ("single", "ddp"):
        load_model_weights(model, ckpt / MODEL_DIR)
    elif engine == "fsdp":
        _load_dcp(model, ckpt)
    elif engine == "deepspeed":
        _load_deepspeed(model, ckpt)
    else:  # pragma: no cover
        raise AssertionError(engine)
    return model, tokenizer, recipe, ckpt


def _materialize_trainable(model: torch.nn.Module) -> None:
    """Give the trainable (adapter) parameters of a meta-built model fp32 CPU memory; the
    checkpoint load fills them."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.requires_grad and p.is_meta:
                module.register_parameter(name, torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32)))


def _load_tok(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _load_dcp(model: torch.nn.Module, ckpt: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from llmft.engines.fsdp import DCP_DIR

    state = model.state_dict()
    if hasattr(model, "peft_config"):
        keep = _trainable_names(model)
        state = {k: v for k, v in state.items() if k in keep}
    holder = {"model": state}
    dcp.load(holder, checkpoint_id=str(ckpt / DCP_DIR), no_dist=True)
    missing, unexpected = model.load_state_dict(holder["model"], strict=False)
    assert not unexpected, unexpected[:5]


def _load_deepspeed(model: torch.nn.Module, ckpt: Path) -> None:
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from llmft.engines.deepspeed import DS_DIR, TAG
    from llmft.engines.single import check_loaded_keys

    peft = hasattr(model, "peft_config")
    if deepspeed_dp_size(ckpt) is None:
        # ZeRO-0 keeps nothing partitioned: the module's whole state dict is in the model-states
        # file, which holds only tensors and plain Python values.
        model_states = ckpt / DS_DIR / TAG / "mp_rank_00_model_states.pt"
        state = torch.load(model_states, map_location="cpu", weights_only=True)["module"]
    else:
        # DeepSpeed unpickles its own files here (see the module docstring); its progress prints are muted.
        with contextlib.redirect_stdout(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(
                str(ckpt / DS_DIR), tag=TAG, exclude_frozen_parameters=peft
            )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if peft:  # only the adapter was saved: the frozen base is the rebuilt one
        assert not unexpected, unexpected[:5]
        unloaded = sorted(_trainable_names(model) & set(missing))
        assert not unloaded, f"{ckpt} lacks adapter weights {unloaded[:5]}"
    else:
        check_loaded_keys(model, missing, unexpected)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights the run trained, keyed by parameter name (for comparisons across engines)."""
    names = _trainable_names(model) if hasattr(model, "peft_config") else {n for n, _ in model.named_parameters()}
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if n in names}
