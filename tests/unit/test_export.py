"""Checkpoint model folders and `llmft export`: adapters and merged models reproduce the trained logits.

The QLoRA scenario of docs/qlora.md: a tiny model saved as a HF directory (weights +
tokenizer with a chat template), loaded by name_or_path, quantized to 4 bits on CPU,
trained for 30 steps, checkpointed and exported.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from llmft.checkpoint.layout import TrainerState
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.export.export import BASE_DIR, export, export_model_dir
from llmft.model.build import build_model, load_base_model
from llmft.model.quant import keep_4bit_layout
from llmft.model.save import save_base_model, save_model_dir
from llmft.recipe import load_recipe, to_yaml

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 320,
    # A wider init than the default 0.02: the head then reaches logits large enough for a
    # rank-4 adapter on a frozen head to fit the batch within 30 steps.
    "initializer_range": 0.1,
}
# same length: the batch needs no padding
TEXT = ["<|user|>\nreverse world<|end|><|assistant|>\ndlrow", "<|user|>\nreverse hello<|end|><|assistant|>\nolleh"]


def make_recipe(root, model: dict, **sections):
    data = {
        "run": {"output_dir": str(root / "run"), "seed": 0},
        "model": {"dtype": "fp32", "attn_implementation": "eager", **model},
        "peft": {"method": "lora", "r": 4, "alpha": 8.0},
        "data": {"train": str(root / "train.jsonl")},
        "batch": {"global_batch_size": 2, "micro_batch_size": 2},
        "train": {"max_steps": 30},
        **sections,
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path)


def train(model, ids: torch.Tensor, steps: int, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits.float()


def checkpoint(model, tokenizer, recipe, step_dir):
    """The single-process checkpoint layout (what llmft train writes), plus the COMPLETE marker."""
    save_model_dir(model, tokenizer, step_dir)
    (step_dir / "recipe.yaml").write_text(to_yaml(recipe))
    step = int(step_dir.name.removeprefix("step-"))
    state = TrainerState(
        step=step, samples=0, tokens=0, epoch=0.0, world_size=1, engine="single", batch=None, scheduler={}
    )
    (step_dir / "trainer_state.json").write_text(state.to_json())
    (step_dir / "COMPLETE").write_text(json.dumps({"step": step}))
    return step_dir


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


@pytest.fixture(scope="module")
def ids(tok):
    return tok(TEXT, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tok, ids):
    """QLoRA by name_or_path on a tiny HF dir, trained 30 steps and checkpointed."""
    root = tmp_path_factory.mktemp("qlora")
    hf_dir = root / "tiny-llama"
    torch.manual_seed(0)
    from transformers import AutoConfig

    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    recipe = make_recipe(root, {"name_or_path": str(hf_dir), "quantization": {"bits": 4}})
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)  # the model's own, as load_tokenizer would pick
    model = build_model(recipe, tokenizer)
    losses = train(model, ids, steps=30)
    step_dir = checkpoint(model, tokenizer, recipe, root / "run" / "checkpoints" / "step-30")
    return {"root": root, "hf_dir": hf_dir, "model": model, "losses": losses, "step_dir": step_dir}


def test_qlora_by_name_learns(qlora_run):
    model = qlora_run["model"]
    assert type(model.base_model.model.model.layers[1].mlp.gate_proj.base_layer.weight).__name__ == "Params4bit"
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    losses = qlora_run["losses"]
    assert losses[-1] < 0.5 * losses[0], losses


def test_adapter_export_reproduces_the_trained_model(qlora_run, ids):
    out = export(qlora_run["root"] / "run")  # the run dir means its latest checkpoint
    assert out == qlora_run["root"] / "run" / "exported" / "step-30"
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt")) for n in names)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(qlora_run["hf_dir"].resolve())
    assert AutoTokenizer.from_pretrained(out).chat_template

    from peft import PeftModel

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    base = AutoModelForCausalLM.from_pretrained(
        config["base_model_name_or_path"], quantization_config=quant, dtype=torch.float32
    )
    keep_4bit_layout(base)  # on AVX512-BF16 CPUs bnb would evaluate with its bf16 inference kernel
    reloaded = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(logits(reloaded, ids), logits(qlora_run["model"], ids), rtol=1e-4, atol=1e-4)


def test_merged_qlora_export_is_the_adapter_on_the_unquantized_base(qlora_run, ids):
    from peft import PeftModel

    out = export_model_dir(qlora_run["step_dir"], qlora_run["root"] / "merged", merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not hasattr(merged.config, "quantization_config") and merged.config.use_cache
    assert merged.dtype == torch.float32
    base = AutoModelForCausalLM.from_pretrained(qlora_run["hf_dir"], dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, qlora_run["step_dir"] / "model")
    torch.testing.assert_close(logits(merged, ids), logits(adapter, ids), rtol=1e-4, atol=1e-4)
    # Merging into the unquantized base drops the NF4 rounding the adapter was trained
    # against; what was learned survives it.
    with torch.no_grad():
        loss = merged(input_ids=ids, labels=ids).loss.item()
    assert loss < 0.5 * qlora_run["losses"][0], (loss, qlora_run["losses"])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tok, ids):
    """LoRA on a fresh model.config base (bf16), trained a few steps; the base saved once."""
    root = tmp_path_factory.mktemp("lora")
    recipe = make_recipe(root, {"config": TINY, "dtype": "bf16"})
    model = build_model(recipe, tok)
    train(model, ids, steps=5)
    save_base_model(model, root / "run" / "checkpoints" / BASE_DIR, dtype=torch.bfloat16)
    step_dir = checkpoint(model, tok, recipe, root / "run" / "checkpoints" / "step-5")
    return {"root": root, "recipe": recipe, "model": model, "step_dir": step_dir}


def test_saved_base_is_the_seeded_base(lora_run):
    base = AutoModelForCausalLM.from_pretrained(lora_run["root"] / "run" / "checkpoints" / BASE_DIR)
    rebuilt = load_base_model(lora_run["recipe"])
    assert base.dtype == torch.bfloat16
    saved, expected = base.state_dict(), rebuilt.state_dict()
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("saved_base", [True, False])
def test_adapter_export_of_a_fresh_base(lora_run, ids, tmp_path, saved_base):
    from peft import PeftModel

    step_dir = lora_run["step_dir"]
    if not saved_base:  # a copy of the step dir alone: export rebuilds the base from the seed
        import shutil

        step_dir = shutil.copytree(step_dir, tmp_path / "step-5")
    out = export_model_dir(step_dir, tmp_path / "adapter", merge_lora=False)
    base_dir = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_dir == str((out / BASE_DIR).resolve())
    # the attention kernel of training: sdpa and eager differ by bf16 rounding
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    reloaded = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(logits(reloaded, ids), logits(lora_run["model"], ids), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_fsdp_checkpoint_is_consolidated(lora_run, ids, tmp_path):
    """An FSDP step dir holds a DCP folder instead of model/: export consolidates it first."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    step_dir = tmp_path / "checkpoints" / "step-5"
    shutil.copytree(lora_run["step_dir"], step_dir, ignore=shutil.ignore_patterns("model"))
    shutil.copytree(lora_run["root"] / "run" / "checkpoints" / BASE_DIR, step_dir.parent / BASE_DIR)
    model = lora_run["model"]
    trainable = {n: p.detach().float() for n, p in model.named_parameters() if p.requires_grad}
    dcp.save({"model": trainable}, checkpoint_id=str(step_dir / "dcp"), no_dist=True)
    state = TrainerState(step=5, samples=40, tokens=0, epoch=1.0, world_size=2, engine="fsdp", batch=None, scheduler={})
    (step_dir / "trainer_state.json").write_text(state.to_json())

    out = export_model_dir(step_dir, tmp_path / "adapter", merge_lora=False)
    assert not list(tmp_path.glob(".llmft-consolidated-*"))
    base = AutoModelForCausalLM.from_pretrained(out / BASE_DIR, attn_implementation="eager")
    torch.testing.assert_close(logits(PeftModel.from_pretrained(base, out), ids), logits(model, ids))


def test_merged_export_of_a_fresh_base(lora_run, ids, tmp_path):
    out = export_model_dir(lora_run["step_dir"], tmp_path / "merged", merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16  # the compute dtype
    expected = logits(lora_run["model"], ids)
    # bf16 rounding of W + BA against W x + B(A x)
    assert (logits(merged, ids) - expected).abs().max() < 0.05 * expected.abs().max()


def test_qlora_on_a_fresh_base_merges_into_the_dequantized_weights(tmp_path, tok, ids):
    recipe = make_recipe(tmp_path, {"config": TINY, "quantization": {"bits": 4}})
    model = build_model(recipe, tok)
    train(model, ids, steps=3)
    step_dir = checkpoint(model, tok, recipe, tmp_path / "run" / "checkpoints" / "step-3")
    save_base_model(model, step_dir.parent / BASE_DIR)
    out = export_model_dir(step_dir, tmp_path / "merged", merge_lora=True)
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(out), ids), logits(model, ids), rtol=1e-4, atol=1e-4
    )


def test_8bit_base_dequantizes_to_the_original_weights(tmp_path, tok):
    from llmft.model.save import base_state_dict

    recipe = make_recipe(tmp_path, {"config": TINY, "quantization": {"bits": 8}})
    state = base_state_dict(build_model(recipe, tok).get_base_model(), torch.float32)
    original = load_base_model(recipe).state_dict()
    assert state.keys() == original.keys()
    for name, weight in original.items():  # int8 rows keep 1/127 of their largest entry
        torch.testing.assert_close(state[name], weight, rtol=0, atol=weight.abs().max().item() / 100)


def test_full_fine_tune_exports_in_the_compute_dtype(tmp_path, tok, ids):
    recipe = make_recipe(tmp_path, {"config": TINY, "dtype": "bf16"}, peft={"method": "none"})
    model = build_model(recipe, tok)
    model.float()  # the engines keep fp32 master weights for a bf16 run
    step_dir = checkpoint(model, tok, recipe, tmp_path / "step-1")
    out = export_model_dir(step_dir, tmp_path / "full", merge_lora=False)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16 and exported.config.use_cache
    torch.testing.assert_close(exported.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_export_errors(tmp_path, lora_run):
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "not-a-checkpoint" / "recipe.yaml").write_text(to_yaml(lora_run["recipe"]))
    with pytest.raises(UserError, match=r"has no model/ folder with a Hugging Face model or PEFT adapter"):
        export_model_dir(tmp_path / "not-a-checkpoint", tmp_path / "x", merge_lora=False)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    with pytest.raises(UserError, match=r"taken: already exists and is not empty"):
        export_model_dir(lora_run["step_dir"], taken, merge_lora=False)
    assert not (tmp_path / ".tmp-taken").exists()


def test_a_damaged_checkpoint_tokenizer_is_named_before_any_weights_load(tmp_path, lora_run, capsys):
    """Found by the DeepSpeed checkpoint fuzzer: an empty tokenizer.json reached export after the
    weights had loaded (their progress bar came first); now it is the first and only thing said."""
    import shutil

    from llmft.cli import main

    step = tmp_path / "step-5"
    shutil.copytree(lora_run["step_dir"], step)
    (step / "tokenizer" / "tokenizer.json").write_text("")
    capsys.readouterr()
    assert main(["export", str(step), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"llmft export: error: {step / 'tokenizer'}: is damaged: the tokenizer does not load (JSONDecodeError: "
    ), err
    assert not (tmp_path / "out").exists()
