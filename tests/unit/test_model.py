"""build_model on a tiny Llama: seeding, dtype, LoRA/DoRA counts, QLoRA and 8-bit on CPU, user errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml

from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.model.build import build_model, warn_batchnorm
from llmft.model.structure import decoder_layer_classes, describe, param_counts
from llmft.recipe import load_recipe

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 320,
}
# embeddings 320x64 and an untied head 64x320, 2 x (4 attention 64x64 + 3 MLP 64x128 + 2 norms), a final norm
TINY_PARAMS = 2 * 320 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
# LoRA r=4 adds r x (in + out) per adapted linear: q, k, v, o are 64->64, gate and up 64->128, down 128->64
LORA_QV = 2 * 2 * 4 * (64 + 64)
LORA_ALL = 2 * (4 * 4 * (64 + 64) + 3 * 4 * (64 + 128))
DORA_MAGNITUDES = 2 * (4 * 64 + 2 * 128 + 64)  # one magnitude per output feature of each adapted linear


def make_recipe(tmp_path, **keys):
    """A valid recipe around the tiny model; keys are dotted recipe keys with '__' for '.'."""
    data = {
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0},
        "model": {"config": dict(TINY), "dtype": "fp32", "attn_implementation": "eager"},
        "peft": {"r": 4, "alpha": 8.0},
        "data": {"train": str(tmp_path / "train.jsonl")},
        "batch": {"global_batch_size": 2, "micro_batch_size": 2},
        "train": {"max_steps": 1},
    }
    for key, value in keys.items():
        *parents, leaf = key.split("__")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two cores shared by several test runs: more than one intra-op thread only spins (30x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def batch(tok, n: int = 2) -> torch.Tensor:
    return tok(["hello tiny model"] * n, return_tensors="pt")["input_ids"]


def trainable_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def test_fresh_model_is_seeded_and_leaves_global_rng_alone(tmp_path, tok):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(make_recipe(tmp_path), tok)
    assert torch.equal(torch.rand(1), expected_next)  # building did not consume the run's RNG
    b = build_model(make_recipe(tmp_path), tok)
    c = build_model(make_recipe(tmp_path, run__seed=1), tok)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert param_counts(a) == (TINY_PARAMS, TINY_PARAMS)
    assert a.config.use_cache is False


def test_dtype_and_attention_are_honoured(tmp_path, tok):
    model = build_model(make_recipe(tmp_path, model__dtype="bf16", model__attn_implementation="sdpa"), tok)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("method", "targets", "expected"),
    [
        ("lora", ["q_proj", "v_proj"], LORA_QV),
        ("lora", "all-linear", LORA_ALL),
        ("dora", "all-linear", LORA_ALL + DORA_MAGNITUDES),
    ],
)
def test_peft_trains_only_the_adapter(tmp_path, tok, method, targets, expected):
    recipe = make_recipe(tmp_path, peft__method=method, peft__target_modules=targets)
    model = build_model(recipe, tok)
    assert param_counts(model) == (expected, TINY_PARAMS + expected)
    assert all("lora_" in n for n in trainable_names(model))
    assert model.peft_config["default"].use_dora is (method == "dora")
    assert describe(model) == f"trainable {expected / 1e3:.1f}K / {(TINY_PARAMS + expected) / 1e3:.1f}K " + (
        f"({100 * expected / (TINY_PARAMS + expected):.2f}%)"
    )


def test_modules_to_save_and_gradient_checkpointing(tmp_path, tok):
    recipe = make_recipe(
        tmp_path,
        peft__method="lora",
        peft__target_modules=["q_proj"],
        peft__modules_to_save=["lm_head"],
        model__gradient_checkpointing=True,
    )
    model = build_model(recipe, tok)
    assert model.is_gradient_checkpointing
    assert any("modules_to_save" in n and "lm_head" in n for n in trainable_names(model))
    model.train()
    ids = batch(tok)
    model(input_ids=ids, labels=ids).loss.backward()  # non-reentrant: no input-grad hook needed
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.grad is not None


def test_qlora_from_config_on_cpu(tmp_path, tok):
    recipe = make_recipe(tmp_path, peft__method="lora", model__quantization={"bits": 4})
    model = build_model(recipe, tok)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer.weight).__name__ == "Params4bit"
    assert q_proj.base_layer.weight.dtype == torch.uint8
    assert all("lora_" in n for n in trainable_names(model))
    # packed 4-bit weights count as the elements they stand for
    assert param_counts(model) == (LORA_ALL, TINY_PARAMS + LORA_ALL)
    ids = batch(tok)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert q_proj.lora_B["default"].weight.grad is not None
    assert q_proj.base_layer.weight.grad is None


def test_qlora_gradients_are_the_same_after_an_eval(tmp_path, tok):
    """Evaluation (eval mode, no grad) must not change the 4-bit layers training runs through.

    bitsandbytes repacks a 4-bit weight for an inference-only kernel on its first eval forward
    on AVX512-BF16 CPUs; after that the base layers passed no gradient to earlier adapters.
    """
    recipe = make_recipe(tmp_path, peft__method="lora", model__quantization={"bits": 4})
    model = build_model(recipe, tok)
    ids = batch(tok)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    packed = q_proj.base_layer.weight.detach().clone()

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    before = grads()
    model.eval()
    with torch.no_grad():
        eval_loss = model(input_ids=ids, labels=ids).loss
    model.train()
    after = grads()
    assert torch.equal(q_proj.base_layer.weight, packed)
    assert before.keys() == after.keys()
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, rtol=0, atol=0, msg=name)
    model.zero_grad(set_to_none=True)
    train_loss = model(input_ids=ids, labels=ids).loss  # dropout is 0: eval and train agree
    torch.testing.assert_close(eval_loss, train_loss, rtol=0, atol=0)


def test_sharded_qlora_stores_packed_weights_in_the_compute_dtype(tmp_path, tok):
    recipe = make_recipe(tmp_path, peft__method="lora", model__dtype="bf16", model__quantization={"bits": 4})
    model = build_model(recipe, tok, quant_storage="bf16")  # what FSDP2's plan asks
    weight = model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight
    assert type(weight).__name__ == "Params4bit" and weight.dtype == torch.bfloat16
    # no fp32 upcast of norms and embeddings: every frozen parameter has the one dtype FSDP flattens
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert param_counts(model)[1] == TINY_PARAMS + LORA_ALL


def test_8bit_loads_and_trains_the_adapter(tmp_path, tok):
    recipe = make_recipe(tmp_path, peft__method="lora", model__quantization={"bits": 8})
    model = build_model(recipe, tok)
    weight = model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    assert type(weight).__name__ == "Int8Params" and weight.dtype == torch.int8
    ids = batch(tok)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_decoder_layer_classes(tmp_path, tok):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = build_model(make_recipe(tmp_path, peft__method="lora"), tok)
    assert decoder_layer_classes(model) == (LlamaDecoderLayer,)


def test_batchnorm_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="llmft"):
        warn_batchnorm(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    assert "BatchNorm" in caplog.text and "accumulation is not equivalent" in caplog.text


# --- user errors --------------------------------------------------------------------------------


def error_of(recipe, tok) -> str:
    with pytest.raises(UserError) as e:
        build_model(recipe, tok)
    return str(e.value)


def test_vocab_smaller_than_tokenizer(tmp_path, tok):
    config = {**TINY, "vocab_size": 256}
    msg = error_of(make_recipe(tmp_path, model__config=config), tok)
    n = len(tok)  # 256 bytes and the special tokens (roles included): a vocab_size of 320 always suffices
    assert 256 < n <= 320
    assert msg.startswith(f"model.config.vocab_size: model vocab_size 256 < tokenizer's {n} tokens")
    assert f"set model.config.vocab_size >= {n}" in msg.lower()


def test_missing_local_dir(tmp_path, tok):
    recipe = make_recipe(tmp_path, model__config=None, model__name_or_path=str(tmp_path / "nope"))
    assert f"model.name_or_path: directory '{tmp_path / 'nope'}' does not exist" in error_of(recipe, tok)


def test_dir_without_config(tmp_path, tok):
    (tmp_path / "empty").mkdir()
    recipe = make_recipe(tmp_path, model__config=None, model__name_or_path=str(tmp_path / "empty"))
    assert "has no config.json" in error_of(recipe, tok)


def test_hub_id_offline(tmp_path, tok, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    recipe = make_recipe(tmp_path, model__config=None, model__name_or_path="llmft-test/no-such-model")
    msg = error_of(recipe, tok)
    assert msg.startswith("model.name_or_path: 'llmft-test/no-such-model' is not a local directory and does not load (")
    assert "'llmft-test/no-such-model' is not in the local Hugging Face cache (HF_HOME)" in msg
    assert "HF_HUB_OFFLINE=1" in msg and "hf download llmft-test/no-such-model" in msg


def test_remote_code_is_not_run_unless_asked(tmp_path, tok):
    repo = tmp_path / "custom"
    repo.mkdir()
    auto_map = {"AutoConfig": "configuration_custom.CustomConfig"}
    (repo / "config.json").write_text(json.dumps({"model_type": "llmft-custom", "auto_map": auto_map}))
    (repo / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    msg = error_of(make_recipe(tmp_path, model__config=None, model__name_or_path=str(repo)), tok)
    assert msg.startswith("model.trust_remote_code: ") and "set model.trust_remote_code=true" in msg


def test_unknown_target_modules(tmp_path, tok):
    recipe = make_recipe(tmp_path, peft__method="lora", peft__target_modules=["qkv"])
    msg = error_of(recipe, tok)
    assert msg.startswith("peft.target_modules: ['qkv'] cannot be adapted")
    assert "q_proj" in msg and "down_proj" in msg


def test_invalid_fresh_config(tmp_path, tok):
    msg = error_of(make_recipe(tmp_path, model__config={**TINY, "hidden_size": 66}), tok)
    assert msg.startswith("model.config.num_attention_heads: is 4, which does not divide hidden_size 66")


def test_flash_attention_unavailable(tmp_path, tok):
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    msg = error_of(make_recipe(tmp_path, model__attn_implementation="flash_attention_2"), tok)
    assert msg.startswith("model.attn_implementation: flash_attention_2 cannot be used here")
