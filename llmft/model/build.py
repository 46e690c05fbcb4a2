"""Build the Hugging Face model of a recipe whole: loaded by name or built from ``model.config``,
quantized if asked, PEFT-wrapped if asked; and ``prepare_model``, the one entry the engines call.

``build_model`` is the one place that turns ``model.*`` and ``peft.*`` into a
``torch.nn.Module`` ready to train: a pretrained model by name (hub id or local
dir), or a fresh one from ``model.config`` seeded by ``run.seed``; optionally
quantized with bitsandbytes (QLoRA); optionally wrapped in a LoRA/DoRA adapter.
Everything a user can get wrong here (a missing model, an offline hub, a
vocabulary smaller than the tokenizer, target modules that do not exist) is a
``UserError`` naming the recipe key, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch
from safetensors.torch import save_model
from transformers.integrations import is_deepspeed_zero3_enabled

from llmft.errors import Problem, UserError, cause_of
from llmft.model import attention, kernels, long_context, loss, moe, moe_quant
from llmft.model.adapters import apply_peft, init_adapters
from llmft.model.heads import PEFT_TASK_TYPES, configure, init_head, model_class, recipe_head
from llmft.model.precision import DTYPES, upcast_trainable
from llmft.model.quant import import_bitsandbytes, prepare_kbit, quantization_config, quantized_skeleton
from llmft.model.source import load_error, load_errors, model_config, resolve_name
from llmft.plan.engines import tiled_mlp_kind

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

    from llmft.plan.layout import RunPlan
    from llmft.recipe.schema import ModelConfig, Recipe


log = logging.getLogger("llmft")

# Non-reentrant checkpointing works with frozen inputs (LoRA on a frozen embedding) and
# with FSDP2; the reentrant variant needs the embedding output to require grad.
GRADIENT_CHECKPOINTING_KWARGS = {"use_reentrant": False}


def build_model(
    recipe: Recipe,
    tokenizer: Any,
    *,
    device: str | torch.device = "cpu",
    init_context: Callable[[], ContextManager] | None = None,
    quant_storage: str | None = None,
) -> torch.nn.Module:
    """The model to train: loaded or built, quantized if asked, PEFT-wrapped if asked.

    ``init_context`` (a context-manager factory from a sharding engine: meta-device init for
    FSDP2) wraps the construction only; the model is then left where that context put it, and
    a pretrained model is built from its config without its weights, which the engine loads
    into its shards. Without it (and for a quantized model, which must be built from real
    weights) the model ends up on ``device``.
    ``quant_storage``: the storage dtype of packed 4-bit weights the run plan decided (FSDP2 needs
    the compute dtype, so that every parameter it shards has one dtype, and so does ZeRO-3); None: the
    recipe's, or uint8.
    """
    m = resolved_model(recipe)
    dtype = DTYPES[m.dtype]
    quant = quantization_config(m.quantization, dtype, storage=quant_storage)
    if quant is not None:  # before transformers' quantizer imports it: no Hub fetch unless asked
        import_bitsandbytes(m.hub_kernels)
    head = recipe_head(recipe)  # the objective's head: the causal LM, or a scalar score (reward models)
    config = model_config(m)
    configure(config, head, tokenizer)
    check_vocab(config, tokenizer, m)

    # bitsandbytes packs real weights as they load, so a quantized base is built whole and sharded
    # by the engine afterwards; except a pretrained 4-bit base under a meta-device init (FSDP2):
    # its packed layout is built empty (quantized_skeleton) and the engine quantizes each weight
    # into its shards (``llmft.model.meta``).
    packs_later = quant is not None and quant.load_in_4bit and m.config is None and init_context is not None
    context = init_context if quant is None or packs_later else None
    # Under a sharded init the parameters stay where it puts them. transformers enters
    # zero.Init by itself while a ZeRO-3 HfDeepSpeedConfig is alive, and refuses a device_map then.
    placed = context is None and not is_deepspeed_zero3_enabled()
    device_map = {"": str(device)} if placed else None
    with context() if context is not None else contextlib.nullcontext():
        if m.config is not None:
            model = _from_config(m, config, recipe.run.seed, dtype, quant, device, head)
        elif context is not None:
            model = _architecture(m, config, dtype, head)
            if packs_later:
                quantized_skeleton(model, quant, dtype)
        else:
            model = _from_pretrained(m, config, dtype, quant, device_map=device_map, head=head, seed=recipe.run.seed)
    if placed and quant is None:
        model = model.to(device)

    warn_batchnorm(model)
    model.config.use_cache = False  # the KV cache is for generation; training only pays its memory
    if quant is not None:
        checkpointing = GRADIENT_CHECKPOINTING_KWARGS if m.gradient_checkpointing else None
        prepare_kbit(model, checkpointing)
    elif m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GRADIENT_CHECKPOINTING_KWARGS)
    if recipe.peft.method != "none":
        model = apply_peft(model, recipe.peft, PEFT_TASK_TYPES[head])
        init_adapters(model, recipe.run.seed)
    if quant is not None and quant.load_in_4bit:  # the fused MoE experts in 4 bits too, LoRA kept on them
        moe_quant.quantize_experts(model, quant, recipe)
    # Activation offload, tiled MLP: after checkpointing and the adapters; the engine picks the tiling.
    long_context.apply(model, m, tiled_mlp_kind(recipe.distributed.engine))
    moe.install(model, recipe.moe)  # an MoE router's balancing loss, as an auxiliary term of the step
    return model


def prepare_model(plan: RunPlan, tokenizer: Any, device: torch.device, **kwargs: Any) -> torch.nn.Module:
    """The model of a run as the engines train it: built per the plan's decisions, trainable weights
    in fp32 (``upcast_trainable``), on ``device`` unless quantized (bitsandbytes placed it)."""
    kernels.check_available(plan.recipe.model)  # before any weight is loaded
    model = build_model(
        plan.recipe,
        tokenizer,
        device=str(device),
        quant_storage=plan.quant_storage,
        **kwargs,
    )
    upcast_trainable(model)
    install_chunked_loss(plan, model)
    kernels.apply(model, plan.recipe.model)  # Liger, flash-attention boundaries, compile (before sharding)
    return model.to(device) if plan.recipe.model.quantization is None else model


def install_chunked_loss(plan: RunPlan, model: torch.nn.Module) -> None:
    """Where the plan says so, the LM head computes the loss in chunks (``llmft.model.loss``)."""
    if plan.chunked_loss:
        loss.install(model)


def load_base_model(recipe: Recipe, *, dtype: torch.dtype | None = None, tokenizer: Any = None) -> PreTrainedModel:
    """The unquantized base model without adapters, for export: by name, or rebuilt from the seed."""
    m = resolved_model(recipe)
    dtype = dtype or DTYPES[m.dtype]
    head = recipe_head(recipe)
    config = model_config(m)
    configure(config, head, tokenizer)
    if m.config is not None:
        return _from_config(m, config, recipe.run.seed, dtype, None, "cpu", head)
    return _from_pretrained(m, config, dtype, None, device_map={"": "cpu"}, head=head, seed=recipe.run.seed)


def resolved_model(recipe: Recipe) -> ModelConfig:
    """``recipe.model`` with ``attn_implementation: auto`` resolved to what this machine runs
    (``llmft.model.attention``)."""
    m = recipe.model
    chosen = attention.choose(m.attn_implementation, recipe.data.packing)
    if chosen != m.attn_implementation:
        log.info("attention: %s (model.attn_implementation auto)", chosen)
    return dataclasses.replace(m, attn_implementation=chosen)


def check_vocab(config: PretrainedConfig, tokenizer: Any, m: ModelConfig) -> None:
    """Token ids at or past vocab_size would index past the embedding: fail before building."""
    if tokenizer is None:
        return
    vocab_size = config.get_text_config().vocab_size
    num_tokens = len(tokenizer)
    if vocab_size >= num_tokens:
        return
    if m.config is not None:
        where, fix = "model.config.vocab_size", f"Set model.config.vocab_size >= {num_tokens}."
    elif m.tokenizer:
        where = "model.tokenizer"
        fix = "Use the model's own tokenizer (unset model.tokenizer), or one whose vocabulary the model covers."
    else:
        where = "model.name_or_path"
        fix = (
            f"Resize the embeddings to >= {num_tokens} (model.resize_token_embeddings) and save the model first; "
            "llmft does not resize them silently."
        )
    raise UserError(
        Problem(
            where,
            f"model vocab_size {vocab_size} < tokenizer's {num_tokens} tokens: ids would index past the embedding",
            fix,
        )
    )


def warn_batchnorm(model: torch.nn.Module) -> None:
    names = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
    if names:
        log.warning(
            "the model has %d BatchNorm layer(s) (%s): their statistics are per micro-batch, so gradient "
            "accumulation is not equivalent to one big batch for them",
            len(names),
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )


def _from_config(
    m: ModelConfig,
    config: PretrainedConfig,
    seed: int,
    dtype: torch.dtype,
    quant: BitsAndBytesConfig | None,
    device: str | torch.device,
    head: str,
) -> PreTrainedModel:
    """A fresh model, the same weights for the same seed (and torch/transformers versions).

    The global RNG is left untouched so that building the model does not shift the
    data order or dropout of the run.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = model_class(head).from_config(config, dtype=dtype, attn_implementation=m.attn_implementation)
        except ImportError as e:  # an attention kernel or another package not installed
            raise load_error(m, "model.config", e) from None
        except Exception as e:  # config values checked only at construction (e.g. hidden size vs heads)
            raise UserError(
                Problem("model.config", f"cannot build the model ({cause_of(e)})", "Fix that model.config field.")
            ) from None
    if quant is None:
        return model
    return _quantize_fresh(model, m, dtype, quant, device, head)


def _quantize_fresh(
    model: PreTrainedModel,
    m: ModelConfig,
    dtype: torch.dtype,
    quant: BitsAndBytesConfig,
    device: str | torch.device,
    head: str,
) -> PreTrainedModel:
    """Quantize a model built from a config the way a pretrained one is: on load.

    bitsandbytes quantization lives in transformers' loading path (the HfQuantizer swaps
    nn.Linear for bnb layers, packs each weight as it is read, and marks the model as
    quantized, which PEFT's k-bit preparation checks). A fresh model has no files, so
    its random weights are written once to a temporary directory and loaded back:
    public API only, and exactly the code path of a QLoRA run on a pretrained model.
    Swapping layers by hand (replace_with_bnb_linear + Params4bit.to) skips that
    bookkeeping and breaks across versions. The cost is one write of a model that is
    small by construction (model.config is for tests, demos and from-scratch runs).
    """
    with tempfile.TemporaryDirectory(prefix="llmft-quantize-") as tmp:
        # Not save_pretrained: under torch.distributed it writes on rank 0 only, and every rank
        # needs its own copy here.
        model.config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del model
        # disable_mmap: the tensors must not outlive the files they would be mapped from
        try:
            quantized = model_class(head).from_pretrained(
                tmp,
                dtype=dtype,
                attn_implementation=m.attn_implementation,
                quantization_config=quant,
                device_map={"": str(device)},
                use_safetensors=True,
                disable_mmap=True,
                use_kernels=m.hub_kernels,  # transformers >= 5.2x: None means fetch Hub kernels on CUDA
            )
        except ImportError as e:  # bitsandbytes not installed
            raise load_error(m, "model.config", e) from None
    # like any fresh model: no (deleted) directory for PEFT to look up when saving the adapter
    quantized.config.name_or_path = quantized.name_or_path = ""
    return quantized


def _from_pretrained(
    m: ModelConfig,
    config: PretrainedConfig,
    dtype: torch.dtype,
    quant: BitsAndBytesConfig | None,
    device_map: dict[str, str] | None,
    head: str,
    seed: int,
) -> PreTrainedModel:
    """A pretrained model; a score head its checkpoint lacks gets llmft's seeded init (``llmft.model.heads``)."""
    name = resolve_name(m.name_or_path)
    # transformers draws the init of weights the checkpoint lacks (a new score head) from the global RNG:
    # forked, so that data order and dropout see the RNG a meta-device build (which draws none) leaves
    with load_errors(m, name), _rng_kept(device_map):
        model, info = model_class(head).from_pretrained(
            name,
            config=config,
            revision=m.revision,
            trust_remote_code=m.trust_remote_code,
            dtype=dtype,
            attn_implementation=m.attn_implementation,
            quantization_config=quant,
            device_map=device_map,
            output_loading_info=True,
            use_kernels=m.hub_kernels,  # transformers >= 5.2x: None means fetch Hub kernels on CUDA
        )
    init_head(model, seed, list(info.get("missing_keys", ())))
    return model


def _rng_kept(device_map: dict[str, str] | None) -> ContextManager:
    """The global RNG of the CPU (and of the CUDA device a model is loaded on) as it was, afterwards."""
    device = torch.device(device_map[""]) if device_map else torch.device("cpu")
    if device.type == "cuda":
        return torch.random.fork_rng(devices=[device.index or 0])
    return torch.random.fork_rng(devices=[])


def _architecture(m: ModelConfig, config: PretrainedConfig, dtype: torch.dtype, head: str) -> PreTrainedModel:
    """A pretrained model's modules without its weights: ``from_pretrained`` refuses a meta-device
    context, so the architecture comes from its config and the engine loads the weights."""
    try:
        return model_class(head).from_config(
            config, dtype=dtype, attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code
        )
    except ImportError as e:  # an attention kernel or another package not installed
        raise load_error(m, resolve_name(m.name_or_path), e) from None
