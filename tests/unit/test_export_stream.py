"""Memory-bounded export (llmft/export/export.py ``stream_model``): merged and full exports are written
one weight file at a time from the base's (or checkpoint's) shards, never building the model.

A tiny Llama saved in 4 shards; a LoRA adapter (with a trained head copy) trained a few steps.
The merged export keeps the shard layout, loads in transformers, and gives the logits of base +
adapter under PEFT; the base is never built (``_load_base`` is made to fail); each shard is read
once and no more than one shard's tensors are alive at a time.
"""

from __future__ import annotations

import pytest
import torch
from helpers import train_inproc, write_recipe
from transformers import AutoConfig, AutoModelForCausalLM

from llmft.export import export as export_mod
from llmft.export.export import export_model_dir, weight_files

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 320,
    "initializer_range": 0.1,
}


@pytest.fixture(scope="module")
def sharded_base(tmp_path_factory):
    from llmft.data.tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("stream")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(root / "base", max_shard_size="80KB")
    byte_tokenizer().save_pretrained(root / "base")
    assert len(weight_files(root / "base")) >= 4
    return root


def _run(root, name: str, *peft: str):
    """A single-process llmft run on the sharded base, 3 AdamW steps, checkpointed."""
    tmp = root / name
    tmp.mkdir()
    recipe = write_recipe(tmp, model__config=None, model__name_or_path=str(root / "base"))
    assert train_inproc(recipe, "train.max_steps=3", "optim.lr=1e-2", *peft) == 0
    return tmp / "run" / "checkpoints" / "step-3"


def _ids():
    return torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    model.eval()
    return model(input_ids=_ids()).logits.float()


def _no_base_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the streaming export must not build the base model")

    monkeypatch.setattr(export_mod, "_load_base", refuse)


def _count_reads(monkeypatch) -> dict:
    """How often each weight file is opened, and the most tensor bytes alive from one file."""
    import safetensors

    seen: dict = {"opens": {}, "peak": 0}
    original = safetensors.safe_open

    class Counted:
        def __init__(self, path, framework, **kw):
            seen["opens"][path] = seen["opens"].get(path, 0) + 1
            self.inner = original(path, framework=framework, **kw)
            self.bytes = 0

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            seen["peak"] = max(seen["peak"], self.bytes)
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            t = self.inner.get_tensor(key)
            self.bytes += t.numel() * t.element_size()
            return t

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    return seen


def test_merged_lora_export_streams_shard_by_shard(sharded_base, monkeypatch):
    from peft import PeftModel

    step = _run(sharded_base, "lora", "peft.method=lora", "peft.r=4", "peft.alpha=8", "peft.modules_to_save=[lm_head]")
    _no_base_build(monkeypatch)
    seen = _count_reads(monkeypatch)
    out = export_model_dir(step, sharded_base / "merged", merge_lora=True)
    monkeypatch.undo()

    base_files = weight_files(sharded_base / "base")
    assert weight_files(out) == base_files and (out / "model.safetensors.index.json").is_file()
    assert sorted(seen["opens"].values()) == [1] * len(base_files)  # every shard read once
    largest = max((sharded_base / "base" / f).stat().st_size for f in base_files)
    assert seen["peak"] <= largest  # one file's tensors at a time

    merged = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert merged.config.use_cache and not (out / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(sharded_base / "base", attn_implementation="eager")
    reference = PeftModel.from_pretrained(base, step / "model")
    want = _logits(reference)
    with reference.disable_adapter():
        assert (_logits(reference) - want).abs().max() > 1e-3  # the adapter trained: a real check
    torch.testing.assert_close(_logits(merged), want, rtol=1e-5, atol=1e-5)


def test_full_export_streams_in_the_compute_dtype(sharded_base, monkeypatch):
    step = _run(sharded_base, "full", "model.dtype=bf16")  # trained with fp32 weights, bf16 autocast
    seen = _count_reads(monkeypatch)
    out = export_model_dir(step, sharded_base / "full-bf16", merge_lora=False)
    monkeypatch.undo()
    assert seen["opens"] and all(n == 1 for n in seen["opens"].values())
    assert weight_files(out) == weight_files(step / "model")
    trained = AutoModelForCausalLM.from_pretrained(step / "model", dtype=torch.float32).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert exported.dtype == torch.bfloat16 and exported.config.use_cache
    got = exported.state_dict()
    assert got.keys() == trained.keys()
    for name in trained:
        assert torch.equal(got[name], trained[name].to(torch.bfloat16)), name
