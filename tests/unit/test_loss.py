"""Chunked loss (llmft/model/loss.py, model.chunked_loss): the same loss and gradients as transformers'
plain path, to 1e-6 relative, on a tiny Llama, with and without LoRA; the planner counts one chunk."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TINY_LLAMA

from llmft.model import loss
from llmft.objectives.sft import micro_loss
from llmft.plan import memory
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe

CHUNK = 7  # tokens per chunk: 2 rows x 24 tokens = 48 rows = 6 full chunks and one of 6


def _recipe(tmp_path, *overrides: str):
    import yaml

    path = tmp_path / "recipe.yaml"
    data = {
        "model": {"config": dict(TINY_LLAMA), "dtype": "fp32", "attn_implementation": "eager"},
        "peft": {"r": 4, "alpha": 8.0},
        "data": {"train": str(tmp_path / "train.jsonl"), "max_seq_len": 24},
        "batch": {"global_batch_size": 2, "micro_batch_size": 2},
        "train": {"max_steps": 1},
    }
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path, list(overrides))


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 320, (2, 24), generator=g)
    labels = input_ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[1, 17:] = -100  # padding
    mask = torch.ones_like(input_ids)
    mask[1, 17:] = 0
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch, num_items):
    model.zero_grad(set_to_none=True)
    value = micro_loss(model, batch, num_items)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("method", ["none", "lora"])
@pytest.mark.parametrize("num_items", [None, 123.0], ids=["token_mean", "global_count"])
def test_chunked_loss_equals_plain(tmp_path, method, num_items):
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import build_model

    recipe = _recipe(tmp_path, f"peft.method={method}")
    plain = build_model(recipe, byte_tokenizer())
    chunked = copy.deepcopy(plain)
    head = loss.install(chunked, chunk_tokens=CHUNK)
    assert loss.find(chunked) is head and loss.find(plain) is None
    batch = _batch()
    items = None if num_items is None else torch.tensor(num_items)

    ref_loss, ref_grads = _loss_and_grads(plain, batch, items)
    got_loss, got_grads = _loss_and_grads(chunked, batch, items)

    assert _rel(got_loss, ref_loss) < 1e-6
    assert ref_grads.keys() == got_grads.keys() and ref_grads
    for name in ref_grads:
        assert _rel(got_grads[name], ref_grads[name]) < 1e-6, name
    # Outside micro_loss the head is the plain module: eval and generation see logits.
    with torch.no_grad():
        logits = chunked(input_ids=batch["input_ids"]).logits
        assert torch.equal(logits, plain(input_ids=batch["input_ids"]).logits)


def test_chunks_are_recomputed_not_kept(tmp_path):
    """Forward keeps no logits: the tensors saved for backward hold no (rows x vocab) block."""
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import build_model

    model = build_model(_recipe(tmp_path), byte_tokenizer())
    loss.install(model, chunk_tokens=CHUNK)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        micro_loss(model, _batch(), None)
    assert saved and not any(shape and shape[-1] == 320 for shape in saved), saved


LONG_ROW = ("data.max_seq_len=4096", "batch.micro_batch_size=1", "batch.global_batch_size=1")


def test_plan_decides_and_planner_counts_one_chunk(tmp_path, monkeypatch):
    recipe = _recipe(tmp_path, *LONG_ROW)
    # auto: 4096 tokens > 2**24 / 320 tokens per chunk? No: one chunk holds 52428 tokens, so off.
    assert not resolve(recipe).chunked_loss
    assert resolve(_recipe(tmp_path, "model.chunked_loss=true")).chunked_loss
    monkeypatch.setattr(memory, "LOSS_CHUNK_ELEMENTS", 320 * 512)  # 512 tokens per chunk
    plan = resolve(recipe)
    assert plan.chunked_loss
    chunked = memory.estimate_memory(plan)
    plain = memory.estimate_memory(resolve(_recipe(tmp_path, *LONG_ROW, "model.chunked_loss=false")))
    assert plain.logits == 4096 * 320 * (4 + 8) and chunked.logits == 512 * 320 * (4 + 8)


def test_qlora_keeps_frozen_weights_in_the_compute_dtype(tmp_path):
    """One GPU first (docs/qlora.md): a bf16 QLoRA model on the single engine has no fp32 copy of a frozen
    weight (norms, embedding, head stay bf16); only the trained adapters are fp32."""
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import prepare_model

    plan = resolve(_recipe(tmp_path, "model.dtype=bf16", "model.quantization={bits: 4}", "peft.method=lora"))
    assert plan.engine == "single"
    model = prepare_model(plan, byte_tokenizer(), torch.device("cpu"))
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "base_layer" not in n}
    packed = {p.dtype for n, p in model.named_parameters() if "base_layer" in n}
    assert frozen == {torch.bfloat16} and packed == {torch.uint8}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}


def test_bf16_frozen_weights_keep_the_loss_of_an_fp32_reference(tmp_path):
    """Precision where it matters: frozen weights in bf16 under bf16 autocast, adapters in fp32, each
    chunk's cross-entropy in fp32. Against the same weights all in fp32, the loss agrees to bf16's
    rounding of the matmuls (measured 1.1e-5 relative; bound 1e-2) and is an fp32 number, and so do
    the adapters' gradients (measured 1.1e-2; bound 0.1)."""
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.engines import autocast_for
    from llmft.model.build import build_model
    from llmft.model.precision import upcast_trainable

    model = build_model(_recipe(tmp_path, "model.dtype=bf16", "peft.method=lora"), byte_tokenizer())
    upcast_trainable(model)
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0: give the adapters a part in the loss
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    reference = copy.deepcopy(model).float()
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    for m in (model, reference):
        loss.install(m, chunk_tokens=CHUNK)
    batch = _batch()
    with autocast_for(torch.bfloat16, torch.device("cpu")):
        got, got_grads = _loss_and_grads(model, batch, None)
    want, want_grads = _loss_and_grads(reference, batch, None)
    assert got.dtype == torch.float32
    assert _rel(got, want) < 1e-2, (got, want)
    for name in want_grads:
        assert _rel(got_grads[name].float(), want_grads[name]) < 0.1, name
