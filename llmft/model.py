"""Load or build the Hugging Face model of a recipe; quantize it; wrap it for PEFT.

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
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
from safetensors.torch import save_model

from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

    from llmft.plan.resolve import RunPlan
    from llmft.recipe.schema import ModelConfig, PeftConfig, QuantizationConfig, Recipe

log = logging.getLogger("llmft")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STORAGE_DTYPES = {**DTYPES, "uint8": torch.uint8}
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
    upcast_unquantized: bool = True,
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
    ``upcast_unquantized``: QLoRA's fp32 norms/embeddings/head (PEFT's k-bit preparation); off for FSDP2
    and ZeRO-3, which shard parameters of one dtype.
    """
    m = recipe.model
    dtype = DTYPES[m.dtype]
    quant = quantization_config(m.quantization, dtype, storage=quant_storage)
    config = model_config(m)
    check_vocab(config, tokenizer, m)

    # bitsandbytes packs real weights as they load, so a quantized base is built whole and sharded
    # by the engine afterwards; except a pretrained 4-bit base under a meta-device init (FSDP2):
    # its packed layout is built empty (quantized_skeleton) and the engine quantizes each weight
    # into its shards (engines/meta_init.py).
    packs_later = quant is not None and quant.load_in_4bit and m.config is None and init_context is not None
    context = init_context if quant is None or packs_later else None
    # Under a sharded init the parameters stay where it puts them. transformers enters
    # zero.Init by itself while a ZeRO-3 HfDeepSpeedConfig is alive, and refuses a device_map then.
    placed = context is None and not _deepspeed_zero3()
    device_map = {"": str(device)} if placed else None
    with context() if context is not None else contextlib.nullcontext():
        if m.config is not None:
            model = _from_config(m, config, recipe.run.seed, dtype, quant, device)
        elif context is not None:
            model = _architecture(m, config, dtype)
            if packs_later:
                quantized_skeleton(model, quant, dtype)
        else:
            model = _from_pretrained(m, config, dtype, quant, device_map=device_map)
    if placed and quant is None:
        model = model.to(device)

    warn_batchnorm(model)
    model.config.use_cache = False  # the KV cache is for generation; training only pays its memory
    if quant is not None:
        _prepare_kbit(model, m.gradient_checkpointing, upcast_unquantized=upcast_unquantized)
    elif m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GRADIENT_CHECKPOINTING_KWARGS)
    if recipe.peft.method != "none":
        model = apply_peft(model, recipe.peft)
        init_adapters(model, recipe.run.seed)
    return model


def prepare_model(plan: RunPlan, tokenizer: Any, device: torch.device, **kwargs: Any) -> torch.nn.Module:
    """The model of a run as the engines train it: built per the plan's decisions, trainable weights
    in fp32 (``upcast_trainable``), on ``device`` unless quantized (bitsandbytes placed it)."""
    from llmft import kernels

    kernels.check_available(plan.recipe.model)  # before any weight is loaded
    model = build_model(
        plan.recipe,
        tokenizer,
        device=str(device),
        quant_storage=plan.quant_storage,
        upcast_unquantized=plan.upcast_unquantized,
        **kwargs,
    )
    upcast_trainable(model)
    install_chunked_loss(plan, model)
    kernels.apply(model, plan.recipe.model)  # Liger, flash-attention boundaries, compile (before sharding)
    return model.to(device) if plan.recipe.model.quantization is None else model


def install_chunked_loss(plan: RunPlan, model: torch.nn.Module) -> None:
    """Where the plan says so, the LM head computes the loss in chunks (``llmft.loss``)."""
    if plan.chunked_loss:
        from llmft import loss

        loss.install(model)


def compute_dtype(recipe: Recipe) -> torch.dtype:
    return DTYPES[recipe.model.dtype]


def upcast_trainable(model: torch.nn.Module) -> None:
    """Mixed precision: trainable weights (and so their grads and optimizer state) live in fp32,
    frozen weights stay in the compute dtype; autocast runs the matmuls in the compute dtype."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def load_base_model(recipe: Recipe, *, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The unquantized base model without adapters, for export: by name, or rebuilt from the seed."""
    m = recipe.model
    dtype = dtype or DTYPES[m.dtype]
    config = model_config(m)
    if m.config is not None:
        return _from_config(m, config, recipe.run.seed, dtype, None, "cpu")
    return _from_pretrained(m, config, dtype, None, device_map={"": "cpu"})


def _deepspeed_zero3() -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


# --- configs ------------------------------------------------------------------------------------


def quantization_config(
    q: QuantizationConfig | None, compute_dtype: torch.dtype, *, storage: str | None = None
) -> BitsAndBytesConfig | None:
    """``model.quantization`` as transformers' ``BitsAndBytesConfig`` (None when off)."""
    if q is None:
        return None
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    # Sharding engines flatten parameters of one dtype; packed uint8 next to bf16 norms would not
    # shard, so the plan stores the packed bytes viewed as the compute dtype there.
    storage = storage or q.quant_storage or "uint8"
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=STORAGE_DTYPES[storage],
    )


def model_config(m: ModelConfig) -> PretrainedConfig:
    """The HF config: from ``model.config`` fields, or read from ``model.name_or_path``."""
    from transformers import AutoConfig

    if m.config is not None:
        fields = dict(m.config)
        try:
            return AutoConfig.for_model(**fields)
        except Exception as e:  # transformers raises ValueError, KeyError or hub's StrictDataclassError
            raise UserError(
                Problem(
                    "model.config",
                    f"is not a valid {fields.get('model_type')!r} config: {_first_line(e)}",
                    "Fix the field named in the message (model_type must be a transformers model type, e.g. llama).",
                )
            ) from None
    name = resolve_name(m.name_or_path)
    try:
        return AutoConfig.from_pretrained(name, revision=m.revision, trust_remote_code=m.trust_remote_code)
    except OSError as e:
        raise _not_found(m, name, e) from None
    except ValueError as e:
        raise _bad_pretrained(m, name, e) from None


def resolve_name(name: str | None) -> str:
    """A local directory (checked here) or a hub id (checked by the hub)."""
    assert name is not None, "validate() guarantees name_or_path or config"
    path = Path(name).expanduser()
    if not (name.startswith((".", "/", "~")) or path.exists()):
        return name
    if not path.is_dir():
        raise UserError(
            Problem(
                "model.name_or_path",
                f"directory '{name}' does not exist",
                "Check the path, or give a Hugging Face hub id such as meta-llama/Llama-3.1-8B.",
            )
        )
    if not (path / "config.json").is_file():
        raise UserError(
            Problem(
                "model.name_or_path",
                f"'{name}' has no config.json, so it is not a Hugging Face model directory",
                "Point it at a directory written by save_pretrained (config.json + *.safetensors).",
            )
        )
    return str(path)


def _not_found(m: ModelConfig, name: str, e: Exception) -> UserError:
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    where = "the local Hugging Face cache (HF_HUB_OFFLINE=1: no downloads)" if offline else "the Hugging Face hub"
    rev = f" at revision {m.revision}" if m.revision else ""
    return UserError(
        Problem(
            "model.name_or_path",
            f"'{name}'{rev} is not a local directory and is not in {where}: {_first_line(e)}",
            f"Download it once with network access (`hf download {name}`) so it is cached in HF_HOME, "
            "point model.name_or_path at a local model directory, or check the id and model.revision "
            "(gated models also need `hf auth login`).",
        )
    )


def _bad_pretrained(m: ModelConfig, name: str, e: Exception) -> UserError:
    if "trust_remote_code" in str(e):
        return UserError(
            Problem(
                "model.trust_remote_code",
                f"'{name}' ships its own model code, which llmft does not run unless asked",
                "Read that code, then set model.trust_remote_code=true if you trust it.",
            )
        )
    return UserError(
        Problem(
            "model.name_or_path",
            f"cannot load '{name}': {_first_line(e)}",
            "Use a causal language model that this transformers version supports.",
        )
    )


def _first_line(e: Exception) -> str:
    """The gist of a library error; a first line that only introduces the next one keeps both."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


# --- construction -------------------------------------------------------------------------------


def _from_config(
    m: ModelConfig,
    config: PretrainedConfig,
    seed: int,
    dtype: torch.dtype,
    quant: BitsAndBytesConfig | None,
    device: str | torch.device,
) -> PreTrainedModel:
    """A fresh model, the same weights for the same seed (and torch/transformers versions).

    The global RNG is left untouched so that building the model does not shift the
    data order or dropout of the run.
    """
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=m.attn_implementation)
        except ImportError as e:
            raise _attn_unavailable(m, e) from None
        except Exception as e:  # config values checked only at construction (e.g. hidden size vs heads)
            raise UserError(
                Problem("model.config", f"cannot build the model: {_first_line(e)}", "Fix that model.config field.")
            ) from None
    if quant is None:
        return model
    return _quantize_fresh(model, m, dtype, quant, device)


def _quantize_fresh(
    model: PreTrainedModel, m: ModelConfig, dtype: torch.dtype, quant: BitsAndBytesConfig, device: str | torch.device
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
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="llmft-quantize-") as tmp:
        # Not save_pretrained: under torch.distributed it writes on rank 0 only, and every rank
        # needs its own copy here.
        model.config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del model
        # disable_mmap: the tensors must not outlive the files they would be mapped from
        quantized = AutoModelForCausalLM.from_pretrained(
            tmp,
            dtype=dtype,
            attn_implementation=m.attn_implementation,
            quantization_config=quant,
            device_map={"": str(device)},
            use_safetensors=True,
            disable_mmap=True,
        )
    # like any fresh model: no (deleted) directory for PEFT to look up when saving the adapter
    quantized.config.name_or_path = quantized.name_or_path = ""
    return quantized


def _from_pretrained(
    m: ModelConfig,
    config: PretrainedConfig,
    dtype: torch.dtype,
    quant: BitsAndBytesConfig | None,
    device_map: dict[str, str] | None,
) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    name = resolve_name(m.name_or_path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            name,
            config=config,
            revision=m.revision,
            trust_remote_code=m.trust_remote_code,
            dtype=dtype,
            attn_implementation=m.attn_implementation,
            quantization_config=quant,
            device_map=device_map,
        )
    except ImportError as e:
        raise _attn_unavailable(m, e) from None
    except OSError as e:  # config found but weights missing (or not cached)
        raise _not_found(m, name, e) from None
    except ValueError as e:
        raise _bad_pretrained(m, name, e) from None


def _architecture(m: ModelConfig, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """A pretrained model's modules without its weights: ``from_pretrained`` refuses a meta-device
    context, so the architecture comes from its config and the engine loads the weights."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code
        )
    except ImportError as e:
        raise _attn_unavailable(m, e) from None


def _attn_unavailable(m: ModelConfig, e: ImportError) -> UserError:
    return UserError(
        Problem(
            "model.attn_implementation",
            f"{m.attn_implementation} cannot be used here: {_first_line(e)}",
            "Set model.attn_implementation=sdpa (works everywhere), or install the kernel it needs.",
        )
    )


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


# --- quantization and PEFT ----------------------------------------------------------------------


def _prepare_kbit(model: PreTrainedModel, gradient_checkpointing: bool, *, upcast_unquantized: bool) -> None:
    """Freeze the quantized base (and checkpoint activations if asked).

    PEFT's prepare_model_for_kbit_training also casts every unquantized weight (norms,
    embeddings, head) to fp32 for stability. Sharding engines need one dtype across the
    parameters they flatten, so for them only the freezing and checkpointing are done.
    """
    keep_4bit_layout(model)
    if upcast_unquantized:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs=GRADIENT_CHECKPOINTING_KWARGS,
        )
        return
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GRADIENT_CHECKPOINTING_KWARGS)


def quantized_skeleton(model: PreTrainedModel, quant: BitsAndBytesConfig, dtype: torch.dtype) -> None:
    """A 4-bit model's modules without weights, as ``from_pretrained`` lays them out before loading.

    transformers' own quantizer swaps the linear layers for bitsandbytes' ``Linear4bit`` and marks
    the model quantized (what PEFT checks); each weight is then replaced by an empty (meta) packed
    tensor of the shape and storage dtype ``quantize_4bit`` gives it, so that a sharding engine splits
    the packed bytes exactly as it splits those of a model built whole. The engine fills them
    (``llmft.engines.meta_init``); the quantization statistics live on each module (``quant_state``),
    where bitsandbytes looks for them once FSDP has swapped the parameter.
    """
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(quant, pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            values_per_element = 2 * torch.empty(0, dtype=w.quant_storage).element_size()
            packed = torch.empty(((w.numel() + 1) // values_per_element, 1), dtype=w.quant_storage, device="meta")
            module.weight = bnb.nn.Params4bit(
                packed,
                requires_grad=False,
                blocksize=w.blocksize,
                compress_statistics=w.compress_statistics,
                quant_type=w.quant_type,
                quant_storage=w.quant_storage,
                module=module,
                bnb_quantized=True,
            )
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def keep_4bit_layout(model: torch.nn.Module) -> None:
    """Keep every 4-bit weight in the layout that training differentiates through.

    On a CPU with AVX512-BF16, bitsandbytes (>= 0.48) repacks a Linear4bit's weight in place
    the first time the layer runs in eval mode without grad, which is what evaluation does,
    and from then on computes that layer with ``gemv_4bit``: an inference kernel with no
    autograd and a bf16 accumulation. Training after the first eval would then lose the
    gradient through every quantized layer (the adapters of earlier layers get none through
    the base path) and evaluate with other numerics than it trains with.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def apply_peft(model: PreTrainedModel, p: PeftConfig) -> torch.nn.Module:
    """Wrap in a LoRA (or DoRA) adapter; only adapter weights (and modules_to_save) stay trainable."""
    from peft import LoraConfig, get_peft_model

    targets = p.target_modules if isinstance(p.target_modules, str) else list(p.target_modules)
    lora = LoraConfig(
        r=p.r,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=targets,
        modules_to_save=list(p.modules_to_save) if p.modules_to_save else None,
        use_dora=p.method == "dora",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if _is_linear(mod)})
        raise UserError(
            Problem(
                "peft.target_modules",
                f"{p.target_modules!r} cannot be adapted: {_first_line(e)}",
                f"Use all-linear, or names of this model's linear layers: {', '.join(names)}.",
            )
        ) from None


# Parameters that exist only in a PEFT model (the adapter's own weights), and the wrapper levels
# PEFT inserts into the path of the module it adapts.
ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
PEFT_WRAPPERS = frozenset({"base_layer", "original_module"})


def base_key(name: str, *, trained_copies: bool = True) -> str | None:
    """The name a parameter of a (PEFT-wrapped) model has in its base model's checkpoint.

    ``base_model.model.`` and PEFT's wrapper levels (``base_layer``, ``original_module``) are
    dropped. None for an adapter weight. A ``modules_to_save.<adapter>`` copy maps to the weight
    it was copied from (it starts as that weight), or to None with ``trained_copies=False``
    (the frozen base is the ``original_module``, not the trained copy).
    """
    parts = name.removeprefix("base_model.model.").split(".")
    if ADAPTER_PARTS.intersection(parts) or (not trained_copies and "modules_to_save" in parts):
        return None
    kept: list[str] = []
    skip_next = False
    for part in parts:
        if skip_next:
            skip_next = False
        elif part == "modules_to_save":
            skip_next = True  # the adapter name follows
        elif part not in PEFT_WRAPPERS:
            kept.append(part)
    return ".".join(kept)


def initial_adapter_weights(model: torch.nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The initial LoRA weights of a PEFT model by parameter name: full size, fp32, on CPU.

    PEFT's default init (A kaiming-uniform like ``nn.Linear``, B zeros; for embeddings A zeros,
    B normal), drawn from ``run.seed`` in module order rather than from the global RNG, so that
    a model built whole and one built on the meta device and sharded (FSDP2) start from the same
    adapters, on every engine and world size. DoRA magnitudes are not here: they are the norms
    of the base weights, which PEFT computes (or the sharding engine, once the weights are loaded).
    """
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, layer in module.lora_A.items():
            a = torch.empty(layer.weight.shape)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            yield f"{name}.lora_A.{adapter}.weight", a
            for pname, p in module.lora_B[adapter].named_parameters():
                yield f"{name}.lora_B.{adapter}.{pname}", torch.zeros(p.shape)
        for adapter, a in module.lora_embedding_A.items():
            yield f"{name}.lora_embedding_A.{adapter}", torch.zeros(a.shape)
            b = module.lora_embedding_B[adapter]
            yield f"{name}.lora_embedding_B.{adapter}", torch.empty(b.shape).normal_(generator=generator)


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Give the adapters their seeded initial weights (see ``initial_adapter_weights``). Adapters
    still on the meta device are left to the engine that materialises them."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_adapter_weights(model, seed):
            p = params[name]
            if p.is_meta:
                return
            p.copy_(value)


def _is_linear(module: torch.nn.Module) -> bool:
    # bnb's Linear4bit / Linear8bitLt subclass nn.Linear
    return isinstance(module, torch.nn.Linear)


# --- inspection ---------------------------------------------------------------------------------


def _logical_numel(p: torch.Tensor) -> int:
    """Elements the parameter stands for, not the elements of its storage."""
    if hasattr(p, "ds_numel"):  # ZeRO-3 partitioned: the local tensor is empty
        return int(p.ds_numel)
    if type(p).__name__ == "Params4bit" and getattr(p, "bnb_quantized", False):
        state = getattr(p, "quant_state", None)
        if state is not None:
            return int(state.shape.numel())
        return p.numel() * p.element_size() * 2  # two 4-bit values per byte of packed storage
    return p.numel()


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; 4-bit weights count their logical elements."""
    trainable = total = 0
    for p in model.parameters():
        n = _logical_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def describe(model: torch.nn.Module) -> str:
    """One line, e.g. ``trainable 1.2M / 8.0B (0.02%)``."""
    trainable, total = param_counts(model)
    share = 100.0 * trainable / total if total else 0.0
    return f"trainable {_human(trainable)} / {_human(total)} ({share:.2f}%)"


def decoder_layer_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The repeated block classes to wrap one by one for FSDP, in model order.

    transformers lists them in ``_no_split_modules``; models without that (or whose list
    names classes absent here) fall back to classes whose name ends in DecoderLayer.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    classes = _classes_where(model, lambda cls: cls.__name__ in names)
    return classes or _classes_where(model, lambda cls: cls.__name__.endswith("DecoderLayer"))


def _classes_where(model: torch.nn.Module, keep: Callable[[type], bool]) -> tuple[type, ...]:
    found: dict[type, None] = {}
    for module in model.modules():
        if keep(type(module)):
            found.setdefault(type(module))
    return tuple(found)
