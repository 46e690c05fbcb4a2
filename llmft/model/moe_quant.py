"""QLoRA with 4-bit experts: the fused ``[experts, ., .]`` weights of a mixture of experts packed in 4 bits,
and their forward, which dequantizes one routed expert at a time and adds LoRA in split order.

bitsandbytes quantizes ``nn.Linear`` layers; the experts of the transformers 5 families are fused
parameters (``mlp.experts.gate_up_proj``, ``down_proj``), which hold nearly all of an MoE model's
weights (54.0 of Qwen3-30B-A3B's 55.6 GiB in bf16). Under ``model.quantization.bits: 4``,
``quantize_experts`` packs every expert's 2-D slice with ``bitsandbytes.functional.quantize_4bit`` (the
recipe's ``quant_type``, blocks of 64) into one ``Params4bit`` per fused weight, whose quantization
state describes the whole ``[experts, ., .]`` tensor in its original layout: bitsandbytes'
``dequantize_4bit`` gives back the fused weight, so the saved base model (``llmft.model.save``) and
the parameter counts (``llmft.model.structure``) treat it like any 4-bit weight. With
``double_quant`` the blocks' scales are quantized over the whole tensor, as bitsandbytes does for
one weight. The weights in ``model.dtype`` are freed.

The forward (``_forward``) is transformers' eager experts loop (``Qwen3MoeExperts.forward``; the
transposed, biased ``GptOssExperts`` too): only the experts a token routes to run, each dequantized
alone, in the forward and again in the backward (``_Expert4bit``), so no dequantized weight outlives
its matmul. LoRA stays PEFT's own (``LoraConfig(target_parameters=...)``: the ``ParamWrapper`` with its
``lora_A``, ``lora_B`` and scaling), so the saved adapter is a plain PEFT adapter for the unquantized
base; only the computation differs: ``x @ A_e.T`` then ``@ B_e.T`` per expert, never the expert's
``B_e @ A_e``. The router is no fused expert weight and stays unquantized.

Under FSDP2 the packed bytes are stored as ``(n, 1)`` elements of the plan's storage dtype (the compute
dtype, like the dense 4-bit weights: ``RunPlan.quant_storage``), which FSDP2 shards on dim 0 with the
other weights of the layer; the quantization state stays whole on the experts module
(``llmft_quant``), and the forward reads the packed bytes through the module attribute at call time:
the gathered parameter FSDP2 put there. A pretrained model built on the meta device gets the empty
packed layout here, and each rank quantizes only the blocks of its part of the bytes
(``llmft.model.meta.quantized_part``): one expert being a whole number of blocks, quantizing the
flattened fused weight block by block is quantizing it expert by expert. ZeRO-3 is the same: it
partitions the ``(n, 1)`` bytes flat, gathers them whole when the MoE block (a ZeRO-3 leaf module) is
entered, and again for its backward, which reads them through the attribute again (``_Expert4bit``);
a pretrained model's parts are quantized by ``llmft.model.zero3.materialize``.
"""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmft.errors import Problem, UserError
from llmft.model.adapters import base_key
from llmft.plan.moe import MoEFamily, moe_family, packs_experts

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

    from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

BLOCKSIZE = 64  # bitsandbytes' 4-bit block (its default on CPU and CUDA)
NESTED_BLOCKSIZE = 256  # the block of the quantized scales under double_quant (bitsandbytes')


@dataclass(frozen=True)
class Pending:
    """The quantization state of a fused weight built empty on the meta device: what the engine
    quantizes each rank's part as (``llmft.model.meta.quantized_part``), which then sets the state."""

    shape: torch.Size
    dtype: torch.dtype


def quantize_experts(model: torch.nn.Module, quant: BitsAndBytesConfig, recipe: Recipe) -> int:
    """Pack the fused expert weights of every MoE layer of ``model`` (PEFT-wrapped or not) in 4 bits and
    give their modules the one-expert-at-a-time forward; returns the number of experts modules. A dense
    model, or a family without fused experts weights, is left as it is."""
    family = moe_family(model.config)
    if family is None:
        return 0
    if not packs_experts(recipe):
        log.info(
            "experts: their fused weights stay in %s under %s (docs/moe.md)",
            recipe.model.dtype,
            recipe.distributed.engine,
        )
        return 0
    owners = _experts_modules(model, family)
    wrappers = _lora_wrappers(model)
    for where, module, names in owners:
        for name in names:
            _check_layout(module, name, where)
        module.llmft_quant = {}
        for name in names:
            weight = getattr(module, name)
            if weight.is_meta:  # built on the meta device: the engine quantizes each rank's part
                packed, module.llmft_quant[name] = _empty_packed(weight, quant), Pending(weight.shape, weight.dtype)
            else:
                packed = _quantize_fused(weight, quant)
                module.llmft_quant[name] = packed.quant_state  # whole on the module: FSDP2 swaps the parameter
            del weight
            delattr(module, name)  # the weight in model.dtype goes with its last reference
            setattr(module, name, packed)
        module.llmft_lora = {name: wrappers.get((id(module), name), []) for name in names}
        module.forward = types.MethodType(_forward, module)
    for wrapper_list in wrappers.values():
        for wrapper in wrapper_list:
            wrapper.forward = types.MethodType(_through, wrapper)
    if owners:
        q = quant.bnb_4bit_quant_type
        log.info(
            "experts: %s of %d MoE layers in 4 bits (%s%s), dequantized one routed expert at a time%s",
            ", ".join(owners[0][2]),
            len(owners),
            q,
            ", double quant" if quant.bnb_4bit_use_double_quant else "",
            "; LoRA on them in split order (x A, then B)" if wrappers else "",
        )
    return len(owners)


def _experts_modules(model: torch.nn.Module, family: MoEFamily) -> list[tuple[str, torch.nn.Module, list[str]]]:
    """(name, module, fused weight names) of every experts module the family's ``expert_weights`` name."""
    suffixes = {}
    for weight in family.expert_weights:
        owner, _, name = weight.rpartition(".")
        suffixes.setdefault(owner, []).append(name)
    found = []
    for module_name, module in model.named_modules():
        key = base_key(module_name) or ""
        for owner, names in suffixes.items():
            if (key == owner or key.endswith("." + owner)) and all(
                isinstance(module._parameters.get(n), torch.nn.Parameter) for n in names
            ):
                found.append((key, module, names))
    return found


def _lora_wrappers(model: torch.nn.Module) -> dict[tuple[int, str], list[torch.nn.Module]]:
    """PEFT's ``ParamWrapper`` s by (id of the module whose weight they adapt, weight name)."""
    found: dict[tuple[int, str], list[torch.nn.Module]] = {}
    if not hasattr(model, "peft_config"):
        return found
    from peft.tuners.lora.layer import ParamWrapper

    for module in model.modules():
        if isinstance(module, ParamWrapper):
            found.setdefault((id(module.get_base_layer()), module.parameter_name), []).append(module)
    return found


def _check_layout(module: torch.nn.Module, name: str, where: str) -> None:
    """Refuse what the forward here does not compute: an experts module without transformers'
    layout flags (``use_experts_implementation``), or expert slices that do not split into whole
    4-bit blocks (one expert's blocks and packed bytes must not straddle the next's)."""
    weight = getattr(module, name)
    fix = "Use model.quantization.bits: 8 or model.quantization: null for this model (docs/moe.md)."
    if not hasattr(module, "is_transposed") or not getattr(module, "has_gate", True) or module.has_post_expert_norm:
        raise UserError(
            Problem(
                "model.quantization.bits",
                f"is 4, but the experts of {where} ({type(module).__name__}) are not laid out as transformers' "
                "fused gate_up_proj/down_proj experts, which is what llmft's 4-bit experts compute",
                fix,
            )
        )
    per_expert = weight[0].numel()
    if weight.ndim != 3 or per_expert % BLOCKSIZE:
        raise UserError(
            Problem(
                "model.quantization.bits",
                f"is 4, but one expert of {where}.{name} holds {per_expert} weights ({list(weight.shape)}), not a "
                f"multiple of the {BLOCKSIZE}-weight 4-bit block, so experts cannot be dequantized one at a time",
                fix,
            )
        )


def _storage(quant: BitsAndBytesConfig) -> torch.dtype:
    """The dtype the packed bytes are stored as: uint8, or the compute dtype where a sharding engine
    shards them with the other weights (``RunPlan.quant_storage``)."""
    return quant.bnb_4bit_quant_storage or torch.uint8


def _params4bit(packed: torch.Tensor, quant: BitsAndBytesConfig, state: Any = None) -> torch.nn.Parameter:
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=BLOCKSIZE,
        compress_statistics=quant.bnb_4bit_use_double_quant,
        quant_type=quant.bnb_4bit_quant_type,
        quant_storage=packed.dtype,
        bnb_quantized=True,
    )


def _empty_packed(weight: torch.Tensor, quant: BitsAndBytesConfig) -> torch.nn.Parameter:
    """The packed layout of the fused ``weight`` on the meta device, as ``_quantize_fused`` stores it."""
    storage = _storage(quant)
    per = 2 * torch.empty(0, dtype=storage).element_size()  # 4-bit values per storage element
    return _params4bit(torch.empty(weight.numel() // per, 1, dtype=storage, device="meta"), quant)


def _quantize_fused(weight: torch.Tensor, quant: BitsAndBytesConfig) -> torch.nn.Parameter:
    """A ``Params4bit`` for the fused ``[experts, a, b]`` weight, quantized one expert's 2-D slice at a
    time: its bytes stored as ``(n, 1)`` elements of the storage dtype."""
    import bitsandbytes.functional as bnb_f

    quant_type = quant.bnb_4bit_quant_type
    experts, per_expert = weight.shape[0], weight[0].numel()
    packed = torch.empty(experts * per_expert // 2, dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(experts * per_expert // BLOCKSIZE, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        for e in range(experts):
            p, state = bnb_f.quantize_4bit(weight[e].detach(), blocksize=BLOCKSIZE, quant_type=quant_type)
            packed[e * per_expert // 2 : (e + 1) * per_expert // 2] = p.view(-1)
            absmax[e * per_expert // BLOCKSIZE : (e + 1) * per_expert // BLOCKSIZE] = state.absmax
        code = bnb_f.get_4bit_type(quant_type, device=weight.device)
        fields: dict[str, Any] = {"absmax": absmax}
        if quant.bnb_4bit_use_double_quant:  # as quantize_4bit(compress_statistics=True) does for one weight
            offset = absmax.mean()
            qabsmax, state2 = bnb_f.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
            fields = {"absmax": qabsmax, "offset": offset, "state2": state2}
        state = bnb_f.QuantState(
            shape=weight.shape, dtype=weight.dtype, blocksize=BLOCKSIZE, code=code, quant_type=quant_type, **fields
        )
    return _params4bit(packed.view(_storage(quant)).view(-1, 1), quant, state)


def expert_state(packed: torch.Tensor, state: Any, e: int) -> tuple[torch.Tensor, Any]:
    """Expert ``e`` of a packed fused weight: its packed bytes and a ``QuantState`` of its weights as one
    row (scales in fp32: with double quant, only the nested blocks that cover this expert are
    dequantized). One row: bitsandbytes 0.50's CPU ``dequantize_4bit`` reads a 2-D shape whose last
    dimension is not a multiple of the block wrongly (a [64, 32] weight comes back off by up to 3x its
    quantization error); a row of whole blocks it reads right."""
    import bitsandbytes.functional as bnb_f

    if state.absmax.device != packed.device:  # the model moved after quantizing (to its device, sharded)
        state.to(packed.device)
    per_expert = math.prod(state.shape[1:])
    blocks = per_expert // state.blocksize
    first, last = e * blocks, (e + 1) * blocks
    if state.nested:
        lo, hi = (
            first - first % NESTED_BLOCKSIZE,
            min(-(-last // NESTED_BLOCKSIZE) * NESTED_BLOCKSIZE, len(state.absmax)),
        )
        nested = state.state2
        scales = bnb_f.dequantize_blockwise(
            state.absmax[lo:hi],
            absmax=nested.absmax[lo // NESTED_BLOCKSIZE : -(-hi // NESTED_BLOCKSIZE)],
            code=nested.code,
            blocksize=NESTED_BLOCKSIZE,
        )
        absmax = scales[first - lo : last - lo] + state.offset
    else:
        absmax = state.absmax[first:last]
    one = bnb_f.QuantState(
        absmax=absmax,
        shape=torch.Size([per_expert]),
        code=state.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
    )
    data = packed.view(torch.uint8).reshape(-1)  # a view: the (gathered) parameter's own bytes
    return data[e * per_expert // 2 : (e + 1) * per_expert // 2], one


def dequantized_expert(weight: torch.nn.Parameter, e: int, state: Any = None) -> torch.Tensor:
    """Expert ``e``'s 2-D weight, dequantized (in the fused weight's layout); ``state``: the fused
    weight's quantization state (None: the one the ``Params4bit`` holds)."""
    import bitsandbytes.functional as bnb_f

    state = state if state is not None else weight.quant_state
    return bnb_f.dequantize_4bit(*expert_state(weight.data, state, e)).view(state.shape[1:])


class _Expert4bit(torch.autograd.Function):
    """``x @ W_e`` (transposed layout) or ``x @ W_e.T`` with one expert's 4-bit weight, dequantized in
    the forward and again in the backward: no dequantized weight is kept for the backward. Nor are the
    packed bytes: the backward reads the parameter through the module attribute again, which the
    engine has gathered for the module's backward (ZeRO-3 re-gathers a released parameter; keeping a
    view of the forward's gathered bytes would hold every MoE layer's experts until the graph goes,
    as bitsandbytes' ``MatMul4Bit`` does: ``llmft.model.zero3.linears_save_their_weights``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: torch.nn.Module, name: str, e: int) -> torch.Tensor:
        import bitsandbytes.functional as bnb_f

        ctx.module, ctx.name, ctx.e = module, name, e
        return _times_expert(x, bnb_f, module, name, e, transpose=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        import bitsandbytes.functional as bnb_f

        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _times_expert(grad, bnb_f, ctx.module, ctx.name, ctx.e, transpose=True), None, None, None


def _times_expert(
    x: torch.Tensor, bnb_f: Any, module: torch.nn.Module, name: str, e: int, transpose: bool
) -> torch.Tensor:
    """``x`` times expert ``e``'s dequantized weight of ``name`` (``transpose``: its transpose, for
    the input's gradient), the packed bytes read from the module's (gathered) parameter now."""
    whole = module.llmft_quant[name]
    packed, state = expert_state(getattr(module, name).data, whole, e)
    w = bnb_f.dequantize_4bit(packed, state).view(whole.shape[1:]).to(x.dtype)
    return x @ w.t() if module.is_transposed == transpose else x @ w


def _project(module: torch.nn.Module, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
    """One expert's projection through fused weight ``name``: the 4-bit base, its bias, and each
    active LoRA adapter as ``(x @ A_e.T) @ B_e.T * scaling`` (PEFT's ``ParamWrapper`` layout: ``lora_A``
    rows ``[e * r, (e + 1) * r)``, ``lora_B`` columns ``e, e + E, ...``)."""
    whole = module.llmft_quant[name]
    # Read at call time: under FSDP2 and ZeRO-3 the attribute is the gathered parameter only inside its unit.
    y = _Expert4bit.apply(x, module, name, e)
    if module.has_bias:
        y = y + getattr(module, f"{name}_bias")[e]
    experts = whole.shape[0]
    for wrapper in module.llmft_lora[name]:
        if wrapper.disable_adapters:
            continue
        for adapter in wrapper.active_adapters:
            if adapter not in wrapper.lora_A:
                continue
            a = wrapper.lora_A[adapter].weight
            b = wrapper.lora_B[adapter].weight
            rank = a.shape[0] // experts
            a_e, b_e = a[e * rank : (e + 1) * rank], b[:, e::experts]
            y = y + ((x.to(a.dtype) @ a_e.t()) @ b_e.t() * wrapper.scaling[adapter]).to(y.dtype)
    return y


def _forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts loop (``Qwen3MoeExperts.forward``, ``GptOssExperts.forward``) on 4-bit
    experts: the experts no token routes to are never dequantized."""
    final = torch.zeros_like(hidden_states)
    experts = self.llmft_quant["gate_up_proj"].shape[0]
    with torch.no_grad():
        # one class more than there are experts: the index an expert-parallel mask uses, skipped
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit.flatten().tolist():
        if e == experts:
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        x = hidden_states[token_idx]
        h = self._apply_gate(_project(self, "gate_up_proj", x, e))
        out = _project(self, "down_proj", h, e) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def _through(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A ``ParamWrapper`` over 4-bit experts: the experts' own forward applies its LoRA (``_project``);
    PEFT's would fold ``B @ A`` of every expert into the weight."""
    return self.base_layer(*args, **kwargs)
