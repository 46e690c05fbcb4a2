"""Build a pretrained model ZeRO-3 partitioned: on the meta device, then each rank fills only its partitions.

The DeepSpeed counterpart of ``llmft.model.meta`` (FSDP2). ``from_pretrained`` under ZeRO-3
maps every weight file on rank 0 and copies each layer in while it is gathered, so rank 0 touches
the whole model (and a 4-bit base is not built under ``zero.Init`` at all: every rank builds it
whole). Instead, the model (PEFT adapters and a QLoRA base's packed layout included) is built on
the meta device exactly as for FSDP2, and then, one parameter at a time:

- a tensor of its full size is allocated (on the device) and made a ZeRO-3 parameter; only this
  rank's range of it is written, the flat range ``[rank * p, (rank + 1) * p)`` of the flattened
  tensor, ``p = ceil(numel / world)`` (DeepSpeed's ``_partition_param`` layout), and DeepSpeed's
  own ``partition`` then keeps that range (in CPU or NVMe offload too) and frees the tensor;
- that range is read from the safetensors files: only the rows that cover it
  (``meta.SafetensorsWeights.read_flat``), so a rank reads and holds about its share of the model;
- a 4-bit weight: only the NF4 blocks that cover this rank's partition of the packed bytes are
  read and quantized (``meta.quantized_part``, as for FSDP2), bit-identical to bitsandbytes quantizing
  it whole on load; the whole statistics go on the parameter and its module, where bitsandbytes
  finds them when DeepSpeed gathers the weight for a forward;
- adapters get llmft's seeded init (``llmft.model.adapters.initial_adapter_weights``); DoRA magnitudes the
  row norms of the loaded base weight, computed while that weight is gathered, one layer at a time;
- on a CPU run (parameters not offloaded) a PEFT run's frozen weight stored in the run's dtype is
  not partitioned over the ranks: it is the weight file's own pages, whole, a ZeRO-3 parameter
  partitioned over a group of this rank alone (``_kept_whole``), so DeepSpeed's fetch points at
  the pages instead of gathering the weight, and a node holds it once, in the page cache.

Peak per rank: its partitions plus its part of one parameter (the full-size allocation is
untouched outside that part, except for small tensors). The model equals the whole build to the
bit (tests/distributed/test_zero3_meta.py). A fresh ``model.config`` model above the whole-build
threshold keeps transformers' own ``zero.Init`` path (``RunPlan.zero_init``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from llmft.errors import Problem, UserError
from llmft.model.adapters import initial_adapter_weights
from llmft.model.heads import initial_head_weights
from llmft.model.meta import ParamSlots, SafetensorsWeights, init_buffers, quantized_part
from llmft.plan.moe import moe_family


def partition_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, end)``: the flat elements of a tensor of ``numel`` elements this rank keeps under
    ZeRO-3 (partitions of ``ceil(numel / world)``, the last one zero-padded by DeepSpeed)."""
    size = -(-numel // world)
    start = min(size * rank, numel)
    return start, min(start + size, numel)


def materialize(
    model: torch.nn.Module,
    slots: ParamSlots,
    weights: SafetensorsWeights,
    ds_config: dict[str, Any],
    *,
    seed: int,
    device: torch.device,
) -> None:
    """Turn a meta-built model into ZeRO-3 parameters holding this rank's partitions of the
    pretrained weights (and the seeded adapters); buffers are recomputed as ``from_pretrained`` does."""
    import deepspeed  # optional (the deepspeed extra): only a ZeRO-3 run gets here

    adapters = dict(initial_adapter_weights(model, seed)) if slots.peft else {}  # shapes: before partitioning
    head = {k: v for k, v in initial_head_weights(slots.base, seed) if k in weights.fresh}  # a new score head
    init = deepspeed.zero.Init(config_dict_or_path=ds_config)  # not entered: its partitioner only
    if not hasattr(init, "_convert_to_deepspeed_param"):
        raise UserError(
            Problem(
                "distributed.zero_stage",
                f"DeepSpeed {deepspeed.__version__} has no zero.Init._convert_to_deepspeed_param, which llmft's "
                "partitioned ZeRO-3 loading of a pretrained model uses",
                "Install the DeepSpeed llmft is tested with (pip install 'deepspeed>=0.17,<0.20'), or use "
                "distributed.engine=fsdp.",
            )
        )
    by_key = {name: key for key, names in slots.by_key().items() for name in names}
    offloaded = ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none") != "none"
    # partitions live in this process's memory; a frozen weight is excluded from checkpoints (PEFT)
    alone = _group_of_this_rank() if device.type == "cpu" and not offloaded and slots.peft else None
    with torch.no_grad():
        init_buffers(model, slots, device)
        for name, owners in slots.owners.items():
            if alone is not None and (mapped := _mapped_whole(slots, weights, by_key, head, name)) is not None:
                _kept_whole(init, mapped, owners, alone)
                continue
            param = _zero_param(init, slots, name, owners, device)
            start, end = partition_range(
                param.ds_numel, param.ds_zero_partition_rank, param.ds_zero_partition_world_size
            )
            if name in slots.packed:
                values, param.quant_state = quantized_part(
                    slots, name, weights, by_key[name], start, end, device, param.ds_process_group
                )
            elif by_key.get(name) in head:
                values = head[by_key[name]].reshape(-1)[start:end].to(slots.dtype[name])
            elif name in by_key:
                values = weights.read_flat(by_key[name], param.ds_shape, start, end).to(slots.dtype[name])
            elif name in adapters:
                values = adapters[name].reshape(-1)[start:end].to(slots.dtype[name])
            elif ".lora_magnitude_vector." in name:  # DoRA: set from the loaded base below
                values = torch.zeros(end - start)
            else:  # ParamSlots names every parameter a base weight or an adapter
                raise AssertionError(f"{name}: neither a pretrained weight nor an adapter")
            param.data.view(-1)[start:end].copy_(values)
            param.partition()  # DeepSpeed copies this rank's range into its partition (or swaps it to NVMe)
        weights.close()
        if slots.peft:
            _dora_magnitudes(model)


def _group_of_this_rank() -> Any:
    """A process group of this rank alone (only its member creates it)."""
    rank = torch.distributed.get_rank()
    return torch.distributed.new_group([rank], use_local_synchronization=True)


def _mapped_whole(
    slots: ParamSlots, weights: SafetensorsWeights, by_key: dict[str, str], head: dict[str, Any], name: str
) -> torch.Tensor | None:
    """A frozen pretrained weight the file holds in the dtype the model uses: the whole weight as
    the weight file's own pages (``SafetensorsWeights.mapped_flat``), nothing copied; None for a
    weight to train, a 4-bit one (quantized at load), a new head, or one stored in another dtype."""
    meta = slots.param(name)
    key = by_key.get(name)
    if meta.requires_grad or name in slots.packed or key is None or key in head:
        return None
    mapped = weights.mapped_flat(key, meta.shape, slots.dtype[name], 0, meta.shape.numel())
    return None if mapped is None else mapped.view(meta.shape)


def _kept_whole(init: Any, mapped: torch.Tensor, owners: list[tuple[torch.nn.Module, str]], alone: Any) -> None:
    """Make ``mapped`` (a frozen weight, the weight file's own pages) a ZeRO-3 parameter
    partitioned over ``alone``, a group of this rank only: its one partition is the whole weight,
    so DeepSpeed's fetch points the parameter at those pages (its no-gather path for a partition
    group of one) instead of gathering it from the other ranks, and its release drops only that
    view. Each rank reads the weight in place; a node holds it once, in the page cache.

    Only for weights a checkpoint leaves out (a PEFT run's frozen base): DeepSpeed would save a
    frozen parameter's partition from every rank, here the whole weight each time. The partition
    is set as DeepSpeed's first ``partition`` sets it, which then only frees the parameter's data."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    param = torch.nn.Parameter(mapped, requires_grad=False)
    param.ds_zero_partition_process_group = alone  # read by _convert_to_deepspeed_param
    for module, attr in owners:
        module._parameters[attr] = param
    init._convert_to_deepspeed_param(param)
    partition = mapped.view(-1)
    partition.requires_grad = False
    partition.ds_numel = partition.numel()
    partition.status = PartitionedParamStatus.AVAILABLE
    partition.final_location = None
    param.ds_tensor = partition
    param.ds_numel_aligned = partition.numel()
    param.partition()  # already partitioned: DeepSpeed only frees the parameter's data


def _zero_param(
    init: Any, slots: ParamSlots, name: str, owners: list[tuple[torch.nn.Module, str]], device: torch.device
) -> torch.nn.Parameter:
    """A real parameter of ``name``'s shape made a ZeRO-3 parameter, not yet partitioned, set on
    every module that holds it (tied weights stay one parameter). Its full-size data is allocated
    but only this rank's range is ever written (the rest of a large allocation is never touched,
    so never resident) before ``partition`` keeps that range and frees the rest."""
    meta = slots.param(name)
    data = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if name in slots.packed:
        import bitsandbytes as bnb  # optional (the qlora extra): only a 4-bit weight gets here

        module, how = slots.packed[name]
        param = bnb.nn.Params4bit(data, requires_grad=False, module=module, bnb_quantized=True, **how)
    else:
        param = torch.nn.Parameter(data, requires_grad=meta.requires_grad)
    for module, attr in owners:
        module._parameters[attr] = param
    init._convert_to_deepspeed_param(param)
    return param


def _dora_magnitudes(model: torch.nn.Module) -> None:
    """DoRA magnitudes: the row norms of each base weight (LoRA B is zero), as PEFT computes them,
    with the base weight and the magnitude gathered, one layer at a time."""
    import deepspeed  # optional (the deepspeed extra): only a ZeRO-3 run gets here

    # peft imports bitsandbytes where installed (seconds): only a PEFT run pays for it
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, dora in module.lora_magnitude_vector.items():
            base = module.get_base_layer()
            with deepspeed.zero.GatheredParameters([base.weight, dora.weight], modifier_rank=0):
                weight = dequantize_module_weight(base)  # in the base's dtype, as PEFT computes the norm
                if dora.fan_in_fan_out:
                    weight = weight.T
                norm = dora.get_weight_norm(weight, torch.zeros_like(weight), module.scaling[adapter])
                dora.weight.copy_(norm)


def linears_save_their_weights(model: torch.nn.Module) -> int:
    """Make every plain ``nn.Linear`` and bitsandbytes ``Linear4bit`` of a ZeRO-3 model keep its
    *parameter* for backward, not the gathered weight; returns how many.

    ``F.linear`` saves ``weight.t()``, a view of the gathered buffer, for the input's gradient: the
    buffer then outlives ZeRO-3's release of the parameter, and by the end of the forward every
    layer's weights are gathered at once (the whole model per rank, measured on a frozen LoRA
    base). DeepSpeed's ``LinearFunctionForZeroStage3`` saves the parameter itself and gathers it
    again in backward, as ``zero.Init``'s ``memory_efficient_linear`` does while a model is built
    under it; here it is kept for the whole run. bitsandbytes' ``MatMul4Bit`` keeps a view of the
    gathered 4-bit weight as a plain attribute of its autograd node (``ctx.tensors``), which
    backward does not free: every packed layer stayed gathered from its forward until the next
    step's forward replaced the graph (measured: the whole 4-bit base per rank between steps).
    ``_Linear4bitSavingWeight`` computes the same two products from the saved parameter."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    bnb = sys.modules.get("bitsandbytes")  # a 4-bit model has imported it; others need not pay for it
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = _saving_forward(module, zero3_linear_wrap)
            count += 1
        elif bnb is not None and isinstance(module, bnb.nn.Linear4bit):
            module.forward = _saving_4bit_forward(module)
            count += 1
    return count


def _saving_forward(module: torch.nn.Linear, linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)

    return forward


class _Linear4bitSavingWeight(torch.autograd.Function):
    """``bitsandbytes.matmul_4bit`` (the same kernel and the same backward product as its
    ``MatMul4Bit``) that saves the 4-bit *parameter* for backward: ZeRO-3 gathers it again for the
    module's backward, and releases it after."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        import bitsandbytes as bnb

        ctx.save_for_backward(weight)
        ctx.quant_state = weight.quant_state
        # grad mode is off in here: bitsandbytes computes the product without an autograd node
        return bnb.matmul_4bit(x, weight, quant_state=weight.quant_state, bias=bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        import bitsandbytes.functional as bnbf

        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            dense = bnbf.dequantize_4bit(weight.view(-1, 1), ctx.quant_state).to(grad_output.dtype)
            grad_x = torch.matmul(grad_output, dense)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def _saving_4bit_forward(module: torch.nn.Module):
    """``Linear4bit.forward`` (compute dtype, quantization state) through ``_Linear4bitSavingWeight``.
    Without its CPU inference repacking, which llmft turns off anyway (``model.quant.keep_4bit_layout``)."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    def forward(x: torch.Tensor) -> torch.Tensor:
        fix_4bit_weight_quant_state_from_module(module)
        if not module.compute_type_is_set:
            module.set_compute_type(x)
            module.compute_type_is_set = True
        dtype = x.dtype
        if module.compute_dtype is not None:
            x = x.to(module.compute_dtype)
        bias = None if module.bias is None else module.bias.to(x.dtype)
        return _Linear4bitSavingWeight.apply(x, module.weight, bias).to(dtype)

    return forward


def moe_blocks_as_leaves(model: torch.nn.Module) -> list[type]:
    """A mixture of experts' MoE blocks (the module holding the router and the experts) as ZeRO-3
    leaf modules: DeepSpeed gathers a block's parameters at once when it is entered and traces none
    of its submodules. Which experts run, and in what order their weights are read (PEFT's LoRA on
    the experts reads weight and factors in its own forward), changes with the routing from one
    forward to the next, which DeepSpeed's prefetch trace does not allow ("tracing error"); as one
    leaf the block is fetched the same way every time. Returns the classes made leaves."""
    from deepspeed.utils import set_z3_leaf_modules

    config = getattr(model, "config", None)
    try:
        family = moe_family(config) if config is not None else None
    except UserError:
        return []
    if family is None:
        return []
    block, router = family.router.rsplit(".", 1)
    classes = sorted(
        {type(m) for name, m in model.named_modules() if name.endswith(f".{block}") and hasattr(m, router)},
        key=lambda c: c.__name__,
    )
    if classes:
        set_z3_leaf_modules(model, classes)
    return classes
