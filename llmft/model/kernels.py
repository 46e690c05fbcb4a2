"""Speed switches applied to a built model: Liger kernels, regional ``torch.compile``, and the
boundaries of packed rows for variable-length (FlashAttention) kernels.

Two entry points, in the order a run meets them (the combinations refused while the recipe is
validated, with no torch, are ``llmft.plan.kernels.recipe_problems``):

- ``check_available(model_cfg)``: before any weight is loaded, what this machine lacks for the
  switches the recipe turned on (CUDA and liger-kernel for ``model.liger_kernels``, a compiler for
  ``model.compile``), as a ``UserError`` naming the key;
- ``apply(model, model_cfg)``: on the built (and PEFT-wrapped) model, before an engine shards or
  wraps it: Liger's patches, the packed-row boundaries for flash attention, and the compilation
  of each decoder layer.

Both are called by ``llmft.model.build.prepare_model`` and ``llmft.model.meta.build_on_meta`` (what
the engines call), not by ``build_model``: export and consolidation build the same model on a machine
that may have neither a GPU nor liger-kernel, and need none of this.

None of them changes the math: every switch has a torch path that computes the same loss (to
float tolerance), and the tests compare the two where the torch path runs.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from llmft.errors import Problem, UserError
from llmft.model.structure import decoder_layer_classes
from llmft.plan.kernels import kernel_paths

if TYPE_CHECKING:
    from llmft.recipe.schema import ModelConfig

log = logging.getLogger("llmft")

# transformers' attention implementations that run varlen kernels when given cu_seq_lens.
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "varlen_sdpa")
LIGER_INSTALL = "pip install -e '.[liger]' (or pip install liger-kernel)"


# --- what this machine lacks (before loading) ---------------------------------------------------


def check_available(m: ModelConfig) -> None:
    """Raise a ``UserError`` when a switch the recipe turned on cannot run here. Called before the
    model is loaded, so that a 70B download or a quantization pass is not wasted on it."""
    if m.liger_kernels:
        _check_liger()
    if m.compile:
        _check_compiler()
    if m.attn_implementation == "flex_attention":
        _check_flex()


def _check_liger() -> None:
    if not torch.cuda.is_available():
        raise UserError(
            Problem(
                "model.liger_kernels",
                "is true, but this machine has no CUDA GPU, and Liger's kernels are Triton GPU kernels",
                "Set model.liger_kernels=false to train with the torch implementations (same loss), "
                "or run on a CUDA GPU.",
            )
        )
    try:  # optional (the liger extra): imported only to check that it can be
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        raise UserError(
            Problem(
                "model.liger_kernels",
                f"is true, but liger-kernel cannot be imported ({e})",
                f"Install it: {LIGER_INSTALL}; or set model.liger_kernels=false.",
            )
        ) from None


def _check_flex() -> None:
    """transformers' flex path compiles FlexAttention; torch runs its backward on CUDA only."""
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        raise UserError(
            Problem(
                "model.attn_implementation",
                f"is flex_attention, but this torch ({torch.__version__}) has no FlexAttention ({e})",
                "Set model.attn_implementation=auto (varlen_sdpa for packed rows: no seq^2 mask), or install torch >= 2.5.",
            )
        ) from None
    if not torch.cuda.is_available():
        raise UserError(
            Problem(
                "model.attn_implementation",
                f"is flex_attention, but this machine has no CUDA GPU, and torch {torch.__version__} has no "
                "FlexAttention backward on CPU (training would stop at the first backward)",
                "Set model.attn_implementation=auto (varlen_sdpa for packed rows: the same document mask, no seq^2 "
                "memory, on any device), or run on a CUDA GPU.",
            )
        )


def _check_compiler() -> None:
    """Inductor generates C++ on CPU and Triton on CUDA; without them the first step would fail."""
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton  # private to torch: imported only where CUDA compiles

        if not has_triton():
            raise UserError(
                Problem(
                    "model.compile",
                    "is true, but Triton (which torch.compile generates GPU kernels with) cannot be imported",
                    "Install the triton build that matches your torch, or set model.compile=false.",
                )
            )
        return
    try:  # inductor is heavy and this helper private: imported only when compile is asked
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except ImportError:  # torch moved its private helper: let torch.compile report it itself
        return
    except Exception as e:
        raise UserError(
            Problem(
                "model.compile",
                f"is true, but torch.compile on CPU needs a C++ compiler and found none ({e})",
                "Install g++ (or set the CXX environment variable), or set model.compile=false.",
            )
        ) from None


# --- applied to the built model -----------------------------------------------------------------


def apply(model: torch.nn.Module, m: ModelConfig) -> None:
    """Turn on the recipe's speed switches on a built model, in place.

    Call it on the model ``build_model`` returns (PEFT-wrapped or not), before an engine wraps or
    shards it: ``fully_shard`` must see the compiled layers (as in torchtitan), and Liger must patch
    the modules before DeepSpeed or DDP hold them. State-dict names do not change.
    """
    hf = causal_lm(model)
    paths = kernel_paths(m)  # one path per module: Liger's layer kernels never inside a compiled layer
    if paths.liger_loss:
        apply_liger(hf, layers=paths.liger_layers)
    if hf.config._attn_implementation in VARLEN_ATTENTION:
        pass_packed_boundaries(hf)
    if paths.compiled_layers:
        compile_layers(hf)


def causal_lm(model: torch.nn.Module) -> Any:
    """The transformers ``*ForCausalLM`` inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def apply_liger(hf: Any, layers: bool = True) -> None:
    """Liger's patches for this model type on this instance: with ``layers`` its RMSNorm, RoPE and
    SwiGLU modules, and always a forward whose training loss is the fused linear cross-entropy (no
    logits materialised). The loss honours ``num_items_in_batch`` (sum / global target count), as the
    loop needs. ``layers`` is off when the decoder layers are compiled (``KernelPaths``)."""
    # optional (the liger extra), checked by check_available before the model is built
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = hf.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # liger would only log this and patch nothing
        raise UserError(
            Problem(
                "model.liger_kernels",
                f"liger-kernel has no kernels for model type {model_type!r}",
                f"Set model.liger_kernels=false. Supported: {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}.",
            )
        )
    _apply_liger_kernel_to_instance(
        model=hf, rope=layers, rms_norm=layers, swiglu=layers, cross_entropy=False, fused_linear_cross_entropy=True
    )
    log.info("liger kernels applied to %s (%s)", type(hf).__name__, "layers and loss" if layers else "loss only")


def compile_layers(hf: torch.nn.Module) -> int:
    """``torch.compile`` each decoder layer in place (regional compilation). Returns how many.

    Every layer of a class shares one compiled graph, so compile time does not grow with depth, and
    the code between layers (embedding, mask construction, head, loss) stays eager, where data-
    dependent control flow (packed-sequence detection) would otherwise break the graph.
    ``Module.compile`` keeps the module object and its parameter names, so checkpoints, PEFT and
    ``fully_shard`` see the same model as without it.
    """
    classes = decoder_layer_classes(hf)
    layers = [mod for mod in hf.modules() if classes and isinstance(mod, classes)]
    for layer in layers:
        layer.compile()
    log.info("torch.compile: %d decoder layer(s) (%s)", len(layers), ", ".join(c.__name__ for c in classes))
    return len(layers)


def pass_packed_boundaries(hf: torch.nn.Module) -> None:
    """Give flash attention the example boundaries of packed rows (``cu_seq_lens``), once per forward.

    Packed rows come with ``position_ids`` that restart at 0 for every example and no attention mask.
    transformers turns that into a block-diagonal mask for sdpa, eager and flex attention. Its
    flash-attention path infers the boundaries itself only when the micro-batch holds ONE row
    (``_is_packed_sequence`` requires batch size 1); with more rows it runs plain causal attention
    over each whole row, across examples. Passing ``cu_seq_lens_q/k`` and ``max_length_q/k``
    (transformers' ``FlashAttentionKwargs``) selects its varlen kernel for any number of rows: no
    cross-example work, and the loss of the unpacked examples.
    """
    decoder = getattr(hf, hf.base_model_prefix, hf)
    if getattr(decoder, "_llmft_packed_boundaries", False):
        return
    decoder.register_forward_pre_hook(_add_boundaries, with_kwargs=True)
    decoder._llmft_packed_boundaries = True


def _add_boundaries(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    position_ids = kwargs.get("position_ids")
    if (
        position_ids is None
        or position_ids.dim() != 2
        or kwargs.get("attention_mask") is not None
        or kwargs.get("past_key_values") is not None  # generation: positions continue a cache
        or kwargs.get("cu_seq_lens_q") is not None
    ):
        return None
    kwargs = dict(kwargs)
    kwargs.update(varlen_kwargs(position_ids))
    return args, kwargs


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` of the flattened ``(rows, seq)`` positions.

    A sequence starts at every row start and wherever the position does not grow by one (the same
    rule as transformers' ``find_packed_sequence_indices``), so a padded tail with its own positions
    0, 1, ... is a sequence of its own, and rows never merge.
    """
    rows, seq = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    begin = starts.reshape(-1).nonzero().view(-1)
    end = torch.tensor([rows * seq], device=position_ids.device)
    cu = torch.cat([begin, end]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())  # one host sync per forward, not one per layer
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
