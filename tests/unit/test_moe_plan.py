"""The planner's numbers for mixture-of-experts models (llmft/plan/shape.py, llmft/plan/memory.py,
llmft/metrics/flops.py; docs/moe.md, "Planning"): total and active parameters read from the config
equal the model transformers builds from it, the two published models land on their published
totals, FLOPs (so tokens/s and MFU) count the active parameters and memory the total, and
``llmft plan`` prints both without importing torch."""

from __future__ import annotations

import dataclasses

import pytest

from llmft.metrics.flops import flops_per_token, mfu
from llmft.plan.memory import count_params, estimate, quantized_bytes_per_param
from llmft.plan.shape import KNOWN, ModelShape, model_shape

SHAPE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # heads x head_dim (64) is not the hidden size: q_proj is 32 -> 64
    "intermediate_size": 48,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
}
TINY = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 24, **SHAPE},
    # layer 0 dense (intermediate_size), layer 1 routed
    "qwen3_moe_sparse": {"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 24,
                         "decoder_sparse_step": 2, **SHAPE},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, **SHAPE},
    # a shared expert of 40 and its hidden -> 1 gate (no q/k/v biases: the planner counts no biases)
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 8, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40, "qkv_bias": False, **SHAPE},
}  # fmt: skip


def built(config: dict):
    """The model transformers builds from ``config``, and its routed experts' parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}.")
    return total, experts


@pytest.mark.parametrize("family", sorted(TINY))
def test_counts_equal_the_built_model(family):
    config = TINY[family]
    shape = ModelShape.from_config(config)
    total, experts = built(config)
    e = shape.experts
    assert shape.num_params == total
    assert shape.expert_params == experts
    assert shape.active_params == total - experts + experts * e.top_k // e.num_experts
    assert shape.active_params < total


def test_sparse_layers_follow_the_config():
    assert ModelShape.from_config(TINY["qwen3_moe"]).experts.num_layers == 2
    assert ModelShape.from_config(TINY["qwen3_moe_sparse"]).experts.num_layers == 1
    only = {**TINY["qwen3_moe"], "mlp_only_layers": [0]}
    assert ModelShape.from_config(only).experts.num_layers == 1
    deepseek = {"model_type": "deepseek_v3", "n_routed_experts": 16, "n_shared_experts": 2, "first_k_dense_replace": 3,
                "moe_intermediate_size": 24, **{**SHAPE, "num_hidden_layers": 5}}  # fmt: skip
    e = ModelShape.from_config(deepseek).experts
    assert (e.num_layers, e.num_experts, e.ffn, e.shared_ffn) == (2, 16, 24, 48)
    assert ModelShape.from_config({**SHAPE, "model_type": "llama"}).experts is None


# Published: Qwen/Qwen3-30B-A3B's model card ("30.5B in total and 3.3B activated"); OpenAI's
# gpt-oss model card (arXiv 2508.10925, table 1: gpt-oss-20b 20.91B total, 3.61B active, an active
# count without the input embedding: attention, 4 of 32 experts, the unembedding).
@pytest.mark.parametrize(
    "name, total, active, embedding_counted",
    [("Qwen/Qwen3-30B-A3B", 30.5e9, 3.3e9, True), ("openai/gpt-oss-20b", 20.91e9, 3.61e9, False)],
)
def test_published_totals(name, total, active, embedding_counted):
    shape = ModelShape.from_config(KNOWN[name])
    ours = shape.active_params - (0 if embedding_counted else shape.vocab_size * shape.hidden_size)
    assert shape.num_params == pytest.approx(total, rel=0.01)
    assert ours == pytest.approx(active, rel=0.03)


def test_model_config_and_known_name_give_one_shape():
    """A recipe's ``model.config`` with the published values plans the model as its hub name does."""
    from types import SimpleNamespace

    named = model_shape(SimpleNamespace(config=None, name_or_path="Qwen/Qwen3-30B-A3B"))
    assert model_shape(SimpleNamespace(config=KNOWN["Qwen/Qwen3-30B-A3B"], name_or_path=None)) == named
    assert named.num_params == 30_532_122_624 and named.active_params == 3_353_032_704


def test_flops_and_mfu_count_active_parameters():
    """6 FLOPs per active matmul weight: the K routed experts a token goes to, not the other E - K."""
    shape = ModelShape.from_config(TINY["qwen3_moe"])
    e = shape.experts
    all_active = dataclasses.replace(shape, experts=dataclasses.replace(e, top_k=e.num_experts))
    idle = shape.expert_params * (e.num_experts - e.top_k) // e.num_experts
    seq = 64
    assert flops_per_token(shape, seq, peft=False) == flops_per_token(all_active, seq, peft=False) - 6 * idle
    assert flops_per_token(shape, seq, peft=True) == flops_per_token(all_active, seq, peft=True) - 4 * idle
    # the active parameters a token multiplies: all but the input embedding and the norms (head untied)
    assert shape.matmul_params == shape.active_params - shape.vocab_size * shape.hidden_size - shape.norm_params
    attention = 12 * shape.num_layers * 64 * seq  # heads x head_dim = 64
    assert flops_per_token(shape, seq, peft=False) == 6 * shape.matmul_params + attention
    per_token = flops_per_token(shape, seq, peft=False)
    assert mfu(1000.0, per_token, 1e12) == pytest.approx(1000.0 * (6 * shape.matmul_params + attention) / 1e12)


def test_memory_counts_every_expert(tmp_path):
    """Weights, gradients and optimizer state hold every expert; under 4-bit QLoRA the fused experts are
    4-bit like the linear layers (llmft.model.moe_quant), the routers stay in the compute dtype, and
    under 8-bit the experts stay in the compute dtype (bitsandbytes quantizes linear layers only)."""
    from helpers import write_recipe

    from llmft.recipe import load_recipe

    config = TINY["qwen3_moe"]
    shape = ModelShape.from_config(config)
    full = load_recipe(write_recipe(tmp_path / "full", model__config=config), [])
    assert count_params(full, shape).base == shape.num_params
    est = estimate(full, "single", 1, 1, 1)
    assert est.weights == shape.num_params * 4  # trained weights are fp32
    assert est.gradients == shape.num_params * 4 * 1  # single: one gradient copy
    qlora = load_recipe(
        write_recipe(tmp_path / "qlora", model__config=config),
        ["peft.method=lora", "model.quantization.bits=4", "model.dtype=bf16"],
    )
    weights = estimate(qlora, "single", 1, 1, 1).weights
    q = quantized_bytes_per_param(4, qlora.model.quantization.double_quant)
    packed = shape.linear_params + shape.expert_params
    assert weights == round(packed * q + (shape.num_params - packed) * 2)
    assert shape.router_params > 0  # among the bf16 weights
    int8 = load_recipe(
        write_recipe(tmp_path / "int8", model__config=config),
        ["peft.method=lora", "model.quantization.bits=8", "model.dtype=bf16"],
    )
    weights = estimate(int8, "single", 1, 1, 1).weights
    q8 = quantized_bytes_per_param(8, False)
    assert weights == round(shape.linear_params * q8 + (shape.num_params - shape.linear_params) * 2)


def test_expert_adapters_count_as_peft_builds_them(tmp_path):
    """LoRA on the fused experts (``peft.target_experts``) adds what PEFT's ``target_parameters``
    trains: an A (r x in) and a B (out x r) per expert of gate_up_proj and down_proj."""
    from helpers import write_recipe
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.recipe import load_recipe

    config = TINY["qwen3_moe"]
    shape = ModelShape.from_config(config)
    path = write_recipe(tmp_path, model__config=config)
    adapters = {
        on: count_params(
            load_recipe(path, ["peft.method=lora", "peft.r=4", f"peft.target_experts={on}"]), shape
        ).adapters
        for on in ("true", "false")
    }
    lora = LoraConfig(r=4, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)), lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapters["true"] - adapters["false"] == trainable > 0


def test_a_config_json_transformers_5_wrote_is_read_under_either_name_of_its_experts(tmp_path):
    """transformers 5 maps qwen3_moe's ``num_experts`` to ``num_local_experts`` and saves that name."""
    import json

    from transformers import AutoConfig

    from llmft.plan.moe import experts_of

    AutoConfig.for_model("qwen3_moe", num_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in saved and saved["num_local_experts"] == 8
    assert experts_of(saved).num_experts == 8
