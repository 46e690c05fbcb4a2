"""QLoRA with 4-bit experts (llmft/model/moe_quant.py; docs/moe.md): under ``model.quantization.bits: 4``
the fused expert weights of a mixture of experts are packed in 4 bits, dequantized one routed expert
at a time, with PEFT's own LoRA on them applied in split order.

Tiny fp32 MoE models (2 layers, 8 experts, top-2; the families of tests/unit/test_moe.py) built from
``model.config``: the experts' forward and gradients equal transformers' experts with the dequantized
weights, and PEFT's ``ParamWrapper`` on them, within 1e-5; no fused weight is left in fp32 (the experts
take 4.13 bits per weight with double quant); ``llmft train`` trains, and the exported adapter loads in
PEFT and the merged model in transformers; micro 1 x accumulation 4 gives micro 4's gradients; and what
cannot work is refused with the key and the fix.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from helpers import train_inproc, write_recipe
from test_moe import FAMILIES, max_abs_diff, plan_for
from test_moe_lora import R, logits, trained_reference

TOL = 1e-5
QLORA = ["model.quantization={bits: 4}", "peft.method=lora", f"peft.r={R}", "peft.alpha=8"]
# Wider than test_moe's families where a whole fused weight is dequantized (the saved base model):
# bitsandbytes 0.50's CPU dequantize_4bit misreads a last dimension that is not a multiple of 64.
WIDE = {"hidden_size": 64, "head_dim": 16, "moe_intermediate_size": 64, "intermediate_size": 64}


def build(tmp_path, family: str, *overrides: str, config: dict | None = None):
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import build_model

    plan = plan_for(tmp_path, config or FAMILIES[family], 4, *QLORA, *overrides)
    return build_model(plan.recipe, byte_tokenizer(), quant_storage=plan.quant_storage)


def experts_of(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "llmft_lora")]


def reference_experts(model, family: str, experts: torch.nn.Module, layer: int):
    """transformers' experts module of ``family`` with the dequantized weights of ``experts``, wrapped in
    PEFT's ``ParamWrapper`` s with the LoRA weights of ``model`` (PEFT's own LoRA on parameters)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.model.moe_quant import dequantized_expert

    cfg = AutoConfig.for_model(**FAMILIES[family])
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    weights = ["experts.gate_up_proj", "experts.down_proj"]
    ref = get_peft_model(plain, LoraConfig(r=R, lora_alpha=8, target_modules=[], target_parameters=weights))
    trained = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if f"layers.{layer}.mlp.experts" not in name:
                continue
            if "lora_" in name:
                p.copy_(trained[name])
            else:
                base = name.rsplit(".", 1)[-1]
                if base.endswith("_bias"):
                    p.copy_(getattr(experts, base))
                else:
                    n = getattr(experts, base).quant_state.shape[0]
                    p.copy_(torch.stack([dequantized_expert(getattr(experts, base), e) for e in range(n)]))
    return ref.base_model.model.model.layers[layer].mlp.experts


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_4bit_experts_compute_transformers_experts_with_peft_lora_on_the_dequantized_weights(tmp_path, family):
    model = build(tmp_path, family)
    wrapper = model.base_model.model.model.layers[1].mlp.experts  # PEFT's outer ParamWrapper
    experts = experts_of(model)[1]
    assert type(experts.gate_up_proj).__name__ == "Params4bit"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking LoRA: B is zero at init
        for p in wrapper.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ref = reference_experts(model, family, experts, 1)

    tokens, hidden, k, num = 24, FAMILIES[family]["hidden_size"], 2, 8
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(tokens)])
    index[:, 0] = torch.arange(tokens) % 3  # three experts take most tokens, some take none
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    outs, grads = [], []
    for module in (wrapper, ref):
        xi = x.clone().requires_grad_(True)
        out = module(xi, index, weights)
        out.square().sum().backward()
        lora = {n: p.grad for n, p in module.named_parameters() if "lora_" in n}
        outs.append(out.detach())
        grads.append({"x": xi.grad, **lora})
    assert (outs[0] - outs[1]).abs().max() <= TOL
    assert len(grads[0]) == 5 and max_abs_diff(*grads) <= TOL  # x, and A and B of both fused weights

    with torch.no_grad(), model.disable_adapter():  # PEFT's switch reaches the 4-bit experts too
        off = wrapper(x, index, weights)
        base = ref.get_base_layer()(x, index, weights)  # transformers' experts alone
    assert (off - base).abs().max() <= TOL and (off - outs[0]).abs().max() > 1e-3


def _bits_per_weight(experts: torch.nn.Module) -> float:
    """Bytes the fused expert weights hold (packed weights, their scales and offset), as bits per weight
    they stand for; the two lookup tables (16 and 256 fp32 values per fused weight) are left out."""
    total = stored = 0
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name)
        state = w.quant_state
        total += math.prod(state.shape)
        tensors = [w.data, state.absmax]
        if state.nested:
            tensors += [state.offset, state.state2.absmax]
        stored += sum(t.numel() * t.element_size() for t in tensors)
    return 8 * stored / total


def test_no_fused_expert_weight_stays_in_fp32_and_the_experts_take_about_4_bits(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmft")
    model = build(tmp_path / "dq", "qwen3_moe", config={**FAMILIES["qwen3_moe"], **WIDE})
    fused = [
        (n, t)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.ndim == 3 and t.dtype.is_floating_point
    ]
    assert fused == []  # no [experts, ., .] weight left in fp32
    experts = experts_of(model)
    assert len(experts) == 2
    dense = {n: t for n, t in experts[0].named_parameters(recurse=False)}
    assert sorted(dense) == ["down_proj", "gate_up_proj"] and all(t.dtype == torch.uint8 for t in dense.values())
    # 4 bits, one fp8 scale per 64 weights, one fp32 scale per 256 of those: 4.127 bits
    assert _bits_per_weight(experts[0]) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=0.01)
    assert "experts: gate_up_proj, down_proj of 2 MoE layers in 4 bits (nf4, double quant)" in caplog.text
    from llmft.model.structure import param_counts

    # the banner counts the weights the packed experts stand for
    trainable, total = param_counts(model)
    plain = build(tmp_path / "plain", "qwen3_moe", "model.quantization=null", config={**FAMILIES["qwen3_moe"], **WIDE})
    assert total == param_counts(plain)[1] and trainable == param_counts(plain)[0]

    single = build(tmp_path / "single", "qwen3_moe", "model.quantization={bits: 4, double_quant: false}")
    # without double quant: one fp32 scale per 64 weights, 4.5 bits
    assert _bits_per_weight(experts_of(single)[0]) == pytest.approx(4.5, abs=0.01)


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r]


def test_qlora_on_4bit_experts_trains_and_exports_an_adapter_for_the_unquantized_base(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmft.export.export import BASE_DIR, export_model_dir
    from llmft.model.build import load_base_model
    from llmft.recipe import load_recipe

    config = {**FAMILIES["qwen3_moe"], **WIDE}
    overrides = ["optim.lr=0.02", *QLORA]
    recipe_path = write_recipe(tmp_path, model__config=config, train__max_steps=8)
    assert train_inproc(recipe_path, *overrides) == 0
    losses = _losses(tmp_path / "run")
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    step_dir = tmp_path / "run" / "checkpoints" / "step-8"
    recipe = load_recipe(recipe_path, overrides)
    model, saved = trained_reference(recipe, step_dir)
    assert len(experts_of(model)) == 2  # the reference is the trained 4-bit model
    expert_b = [k for k in saved if ".experts." in k and "lora_B" in k]
    assert len(expert_b) == 4 and all(saved[k].abs().max() > 0 for k in expert_b)

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    want = logits(model, ids)
    adapter = export_model_dir(step_dir, tmp_path / "adapter", merge_lora=False)
    # the exported base is the dequantized one the adapter trained against
    base = AutoModelForCausalLM.from_pretrained(adapter / BASE_DIR, attn_implementation="eager")
    assert (logits(PeftModel.from_pretrained(base, adapter), ids) - want).abs().max() <= 1e-4
    # the unquantized base (the same seed, never quantized): off by what quantization moves the base itself
    unquantized = load_base_model(recipe)
    quant_error = float((logits(unquantized, ids) - logits(base, ids)).abs().max())
    got = logits(PeftModel.from_pretrained(unquantized, adapter), ids)
    diff = float((got - want).abs().max())
    print(
        f"logits, max |diff|: PEFT on the unquantized base vs the trained 4-bit model {diff:.3g}, bases {quant_error:.3g}"
    )
    assert 1e-3 < diff <= 1.5 * quant_error

    merged = AutoModelForCausalLM.from_pretrained(
        export_model_dir(step_dir, tmp_path / "merged", merge_lora=True), attn_implementation="eager"
    )
    assert (logits(merged, ids) - want).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_micro_1_x_accumulation_4_equals_micro_4_on_4bit_experts(tmp_path, family):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    import test_moe_lora_ranks as T
    from preference_batches import preference_step

    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    def run(micro: int):
        over = [*T.COMMON, *T.family_overrides({family: []}, family), "model.quantization={bits: 4}"]
        over += [f"batch.micro_batch_size={micro}", "distributed.engine=single"]
        plan = resolve(load_recipe(write_recipe(tmp_path / f"{micro}"), over))
        return preference_step(plan, DistEnv(), T._steps(micro)[: 2 * (T.GLOBAL // micro)], steps=2)[0]

    big, split = run(4), run(1)
    experts = [n for n in big if ".experts." in n and "lora_A" in n]
    assert len(experts) == 4 and all(big[n].abs().max() > 0 for n in experts)  # the experts' LoRA trains
    assert max_abs_diff(big, split) <= TOL


# --- refusals ---------------------------------------------------------------------------------------


def _refusal(tmp_path, family: str, *overrides: str, config: dict | None = None) -> str:
    from llmft.errors import UserError

    with pytest.raises(UserError) as err:
        build(tmp_path, family, *overrides, config=config)
    return str(err.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_under_deepspeed_the_experts_are_packed_and_it_says_so(tmp_path, caplog, stage):
    """ZeRO-3 partitions parameters flat: the packed bytes are ``(n, 1)`` elements of the compute dtype, as
    for FSDP2; below stage 3 they stay uint8 (every rank holds them whole). Either way the same 4-bit
    experts as one process, to the bit (tests/distributed/test_moe_quant_zero.py proves the ranks exact)."""
    from llmft.plan.memory import _packed_experts, count_params
    from llmft.plan.shape import model_shape

    caplog.set_level(logging.INFO, logger="llmft")
    keys = ("distributed.engine=deepspeed", f"distributed.zero_stage={stage}")
    model = build(tmp_path / "deepspeed", "mixtral", *keys)
    single = build(tmp_path / "single", "mixtral", "distributed.engine=single")
    plan = plan_for(tmp_path / "plan", FAMILIES["mixtral"], 4, *QLORA, *keys)
    storage = torch.float32 if stage == 3 else torch.uint8
    assert len(experts_of(model)) == 2 and not [n for n, p in model.named_parameters() if p.dim() == 3]
    for got, want in zip(experts_of(model), experts_of(single), strict=True):
        for name in ("gate_up_proj", "down_proj"):
            w, ref = getattr(got, name), getattr(want, name)
            assert w.dtype == storage and w.dim() == 2 and w.shape[1] == 1, (w.dtype, w.shape)
            assert torch.equal(w.data.view(torch.uint8).reshape(-1), ref.data.reshape(-1))
    assert "experts: gate_up_proj, down_proj of 2 MoE layers in 4 bits (nf4, double quant)" in caplog.text
    assert "stay in" not in caplog.text
    assert _packed_experts(plan.recipe, count_params(plan.recipe, model_shape(plan.recipe.model)), plan.engine) > 0


def test_under_fsdp_the_experts_are_packed_in_the_compute_dtype_for_fsdp2_to_shard(tmp_path):
    """FSDP2 shards parameters of one dtype on dim 0: the packed bytes are ``(n, 1)`` fp32 elements (the
    plan's ``quant_storage``), the state whole on the module, and the experts compute what the uint8
    packing of one process computes, to the bit."""
    from llmft.plan.memory import _packed_experts, count_params
    from llmft.plan.shape import model_shape

    fsdp = build(tmp_path / "fsdp", "qwen3_moe", "distributed.engine=fsdp")
    single = build(tmp_path / "single", "qwen3_moe", "distributed.engine=single")
    plan = plan_for(tmp_path / "plan", FAMILIES["qwen3_moe"], 4, *QLORA, "distributed.engine=fsdp")
    assert _packed_experts(plan.recipe, count_params(plan.recipe, model_shape(plan.recipe.model)), plan.engine) > 0
    for got, want in zip(experts_of(fsdp), experts_of(single), strict=True):
        for name in ("gate_up_proj", "down_proj"):
            w, ref = getattr(got, name), getattr(want, name)
            assert w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] == 1 and ref.dtype == torch.uint8
            assert torch.equal(w.data.view(torch.uint8).reshape(-1), ref.data.reshape(-1))
            assert got.llmft_quant[name].shape == want.llmft_quant[name].shape == ref.quant_state.shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, FAMILIES["qwen3_moe"]["hidden_size"], generator=g)
    index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    weights = torch.softmax(torch.randn(12, 2, generator=g), dim=-1)
    with torch.no_grad():
        outs = [experts_of(m)[0](x, index, weights) for m in (fsdp, single)]
    assert torch.equal(*outs)


def test_the_backward_reads_the_packed_experts_from_the_parameter_again(tmp_path):
    """ZeRO-3 releases a block's gathered parameters after its forward and gathers them again, into a new
    buffer, for its backward: the experts' backward reads the parameter then, and keeps nothing of the
    forward's buffer (which would hold every MoE layer's experts gathered until the graph goes)."""
    experts = experts_of(build(tmp_path, "qwen3_moe", "distributed.engine=single"))[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, FAMILIES["qwen3_moe"]["hidden_size"], generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    weights = torch.softmax(torch.randn(12, 2, generator=g), dim=-1)

    def input_grad(regather: bool) -> torch.Tensor:
        x.grad = None
        out = experts(x, index, weights)
        for name in ("gate_up_proj", "down_proj") if regather else ():
            p = getattr(experts, name)
            again = p.data.clone()  # gathered anew for the backward
            p.data.zero_()  # the forward's buffer, reused for something else
            p.data = again
        out.square().sum().backward()
        return x.grad.clone()

    want = input_grad(regather=False)
    assert want.abs().max() > 0
    assert torch.equal(input_grad(regather=True), want)


def test_experts_that_do_not_split_into_whole_4bit_blocks_are_refused(tmp_path):
    config = {**FAMILIES["qwen3_moe"], "hidden_size": 36, "moe_intermediate_size": 24}
    assert _refusal(tmp_path, "qwen3_moe", config=config) == (
        "model.quantization.bits: is 4, but one expert of model.layers.0.mlp.experts.down_proj holds 864 weights "
        "([8, 36, 24]), not a multiple of the 64-weight 4-bit block, so experts cannot be dequantized one at a "
        "time. Use model.quantization.bits: 8 or model.quantization: null for this model (docs/moe.md)."
    )
