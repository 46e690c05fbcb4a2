"""Turn any engine's checkpoint back into one ordinary (unsharded) model in one process.

The engine that wrote the checkpoint (its ``trainer_state.json``) reads it back
(``llmft.engines.read_checkpoint``): single / DDP a save_pretrained dir, FSDP2 a DCP
folder resharded to one process, DeepSpeed through its own ``zero_to_fp32``. Export and
the cross-engine tests use this.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from llmft.checkpoint.layout import TOKENIZER_DIR, TrainerState, resolve_checkpoint
from llmft.checkpoint.safe_load import without_remote_code
from llmft.data.tokenizer import load_tokenizer
from llmft.engines import read_checkpoint
from llmft.engines.base import trainable_names
from llmft.model.build import build_model
from llmft.plan.engines import engine_spec
from llmft.recipe import Recipe, load_recipe
from llmft.recipe.load import RECIPE_FILE


def checkpoint_engine(ckpt: Path) -> str:
    return TrainerState.read(ckpt).engine


def offline_recipe(recipe: Recipe) -> Recipe:
    """A copy of a checkpoint's recipe for rebuilding its model in one process: plain fp32 weights
    (export and comparisons want them unquantized), no gradient checkpointing."""
    r = copy.deepcopy(recipe)
    r.model.quantization = None
    r.model.dtype = "fp32"
    r.model.gradient_checkpointing = False
    return r


def load_checkpoint_model(
    path: str | Path, *, adapter_only: bool = False, trust_remote_code: bool = False
) -> tuple[torch.nn.Module, object, Recipe, Path]:
    """(model in fp32 on CPU with the checkpoint's weights, tokenizer, recipe, checkpoint dir).

    ``adapter_only`` (for a PEFT run): the frozen base stays on the meta device and only the
    adapter gets memory, which is all a sharded PEFT checkpoint holds and all an adapter
    export needs (a 70B base would otherwise take 280 GB of RAM in fp32 to write a few MB).

    ``trust_remote_code``: the caller's (command line), never the checkpoint's recipe (docs/design.md G7).
    """
    ckpt = resolve_checkpoint(path)
    engine = checkpoint_engine(ckpt)
    recipe = offline_recipe(load_recipe(ckpt / RECIPE_FILE))
    without_remote_code(recipe, ckpt / RECIPE_FILE, trust_remote_code=trust_remote_code)  # G7
    tok_dir = ckpt / TOKENIZER_DIR
    tokenizer = load_tokenizer(recipe.model) if not tok_dir.is_dir() else _load_tok(tok_dir)
    if adapter_only and recipe.peft.method != "none" and engine_spec(engine).sharded_checkpoint:
        model = build_model(recipe, tokenizer, init_context=lambda: torch.device("meta"))
        _materialize_trainable(model)
    else:
        model = build_model(recipe, tokenizer, device="cpu")
    read_checkpoint(engine, model, ckpt)
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


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights the run trained, keyed by parameter name (for comparisons across engines)."""
    names = trainable_names(model) if hasattr(model, "peft_config") else {n for n, _ in model.named_parameters()}
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if n in names}
