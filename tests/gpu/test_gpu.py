"""What only a CUDA GPU can show. Every test here is marked ``gpu`` and skipped without
CUDA (tests/conftest.py). One command runs them all:

    pytest -q -m gpu tests/gpu

Tiny Llamas built from ``model.config``, nothing downloaded; a few seconds each, except the memory
check (a ~190M-parameter model) and the subprocess runs. Tolerances are stated per test: fp32
comparisons are tight, bf16 ones allow bf16 rounding (8 bits of mantissa).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, TINY_LLAMA, checkpoint_weights, metrics, train_inproc, write_data, write_recipe

from llmft.model import kernels

pytestmark = pytest.mark.gpu

PACKED = dict(data__packing=True, model__attn_implementation="sdpa", train__max_steps=3)
CUDA = torch.device("cuda")


def _run(tmp_path: Path, name: str, *overrides: str, **sections) -> list[dict]:
    recipe = write_recipe(tmp_path / name, **sections)
    assert train_inproc(recipe, *overrides) == 0
    return metrics(tmp_path / name / "run")


def _train_subprocess(tmp_path: Path, name: str, **sections) -> subprocess.CompletedProcess:
    """``llmft train`` in a separate process: Liger patches transformers' modules process-wide, and
    peak memory is per process."""
    recipe = write_recipe(tmp_path / name, **sections)
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "train", str(recipe)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _run_subprocess(tmp_path: Path, name: str, **sections) -> list[dict]:
    """The metrics of ``_train_subprocess``."""
    _train_subprocess(tmp_path, name, **sections)
    return metrics(tmp_path / name / "run")


# --- bf16 autocast --------------------------------------------------------------------------------


def test_bf16_autocast_trains_like_fp32(tmp_path):
    """bf16 autocast with fp32 master weights on CUDA: the first loss (before any update) within
    1e-2 relative of fp32, later ones within 3e-2; every step finite and peak memory reported."""
    fp32 = _run(tmp_path, "fp32", **PACKED, model__dtype="fp32")
    bf16 = _run(tmp_path, "bf16", **PACKED, model__dtype="bf16")
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=1e-2)
    for a, b in zip(bf16, fp32, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=3e-2)
        assert a["peak_mem_gb"] > 0


# --- bitsandbytes 4-bit on CUDA -------------------------------------------------------------------


def test_qlora_runs_bitsandbytes_cuda_kernels(tmp_path):
    """Every base linear is a bnb Linear4bit on the GPU whose output equals the matmul with its
    dequantized weight (bf16 tolerance), and a QLoRA run trains the adapters on CUDA."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    from llmft.data.tokenizer import load_tokenizer
    from llmft.model.build import prepare_model
    from llmft.plan.resolve import load_plan

    overrides = dict(PACKED, model__dtype="bf16", peft__method="lora", model__quantization={"bits": 4})
    plan = load_plan(str(write_recipe(tmp_path / "build", **overrides)), [])
    model = prepare_model(plan, load_tokenizer(plan.recipe.model), CUDA)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 7 * TINY_LLAMA["num_hidden_layers"]
    for layer in quantized:  # the base layers inside PEFT's LoRA wrappers
        assert layer.weight.device.type == "cuda" and layer.weight.quant_state is not None
        x = torch.randn(3, layer.in_features, device=CUDA, dtype=torch.bfloat16)
        w = bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(torch.bfloat16)
        want, got = (x @ w.t()).float(), layer(x).float()
        assert (got - want).norm() <= 1e-2 * want.norm()
    del model
    rows = _run(tmp_path, "qlora", **overrides)
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)


# --- packed rows under FlashAttention-2 varlen ----------------------------------------------------


def _flash_attn_or_skip() -> None:
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")


def _tiny(attn: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**TINY_LLAMA)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(CUDA).eval()


def _packed_and_plain() -> tuple[dict, dict]:
    from llmft.data import collate
    from llmft.data.encode import IGNORE_INDEX, Example
    from llmft.data.pack import pack
    from llmft.data.tokens import TokenDataset

    gen = torch.Generator().manual_seed(1)
    exs = []
    for n, masked in [(5, 2), (9, 0), (3, 1), (7, 4), (12, 3), (4, 0), (6, 1), (10, 2)]:
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        exs.append(Example(ids, [IGNORE_INDEX] * masked + ids[masked:]))
    dataset = TokenDataset(pack(exs, 16, 0))
    packed = collate([dataset[i] for i in range(len(dataset))], 0)
    plain = collate([{"input_ids": e.input_ids, "labels": e.labels, "position_ids": None} for e in exs], 0)
    assert packed["input_ids"].shape[0] >= 3
    return {k: v.to(CUDA) for k, v in packed.items()}, {k: v.to(CUDA) for k, v in plain.items()}


def _token_losses(model, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    labels = batch["labels"][:, 1:].flatten()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels, ignore_index=-100, reduction="none")
    return losses[labels != -100].sort().values


def test_flash_attention_varlen_packed_equals_unpacked():
    """FA2 on several packed rows with llmft's boundaries: every token loss equals the unpacked
    (sdpa, padded) one to 2e-2 (bf16); without them FA2 attends across examples."""
    _flash_attn_or_skip()
    packed, plain = _packed_and_plain()
    want = _token_losses(_tiny("sdpa", torch.bfloat16), plain)
    model = _tiny("flash_attention_2", torch.bfloat16)
    leaky = _token_losses(model, packed)
    assert (leaky - want).abs().max() > 5e-2  # transformers alone: plain causal over each row
    kernels.pass_packed_boundaries(model)
    got = _token_losses(model, packed)
    assert torch.allclose(got, want, rtol=0, atol=2e-2)


def test_flash_attention_training_equals_sdpa(tmp_path):
    """The whole loop, packed micro-batches of 2 rows: FA2 (varlen through llmft's boundaries)
    against sdpa (block-diagonal mask), bf16, losses to 1e-2 relative at every step."""
    _flash_attn_or_skip()
    common = dict(PACKED, model__dtype="bf16", batch__micro_batch_size=2)
    sdpa = _run(tmp_path, "sdpa", **common)
    flash = _run(tmp_path, "flash", **{**common, "model__attn_implementation": "flash_attention_2"})
    for a, b in zip(flash, sdpa, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)


# --- model.compile on CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, rel", [("fp32", 1e-4), ("bf16", 2e-3)])
def test_compile_on_off_equal(tmp_path, dtype, rel):
    """Inductor/Triton-compiled decoder layers against eager, 3 steps: losses to ``rel``."""
    eager = _run(tmp_path, "eager", **PACKED, model__dtype=dtype)
    compiled = _run(tmp_path, "compiled", **PACKED, model__dtype=dtype, model__compile=True)
    for a, b in zip(compiled, eager, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel)


# --- Liger kernels --------------------------------------------------------------------------------


def test_liger_kernels_on_off_equal(tmp_path):
    """Liger's RMSNorm/RoPE/SwiGLU and fused linear cross-entropy against transformers' modules,
    bf16, 3 steps: losses to 2e-3 relative (the loss keeps the global token normalisation)."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    common = dict(PACKED, model__dtype="bf16", batch__micro_batch_size=2)
    off = _run_subprocess(tmp_path, "off", **common)
    on = _run_subprocess(tmp_path, "on", **common, model__liger_kernels=True)
    for a, b in zip(on, off, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)


def test_compile_with_liger_prints_no_triton_traceback(tmp_path):
    """Both switches on: the layers are compiled without Liger's layer kernels (its Triton RMSNorm
    failed inside inductor, one traceback per layer), the banner says so, nothing is logged as an
    error, and the losses equal compile alone (Liger's fused loss against torch's) to 2e-3 relative."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")
    common = dict(PACKED, model__dtype="bf16", batch__micro_batch_size=2, model__compile=True)
    done = _train_subprocess(tmp_path, "both", **common, model__liger_kernels=True)
    assert "kernel paths: decoder layers compiled by torch.compile" in done.stderr
    for sign in ("Traceback", "CompilationError", "triton_kernel_wrap"):
        assert sign not in done.stderr + done.stdout, (done.stderr + done.stdout)[-3000:]
    alone = _run_subprocess(tmp_path, "compile", **common)
    for a, b in zip(metrics(tmp_path / "both" / "run"), alone, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)


# --- fused AdamW ----------------------------------------------------------------------------------


def test_fused_adamw_is_chosen_on_cuda_and_equals_foreach():
    from llmft.training.optim import adamw_implementation

    torch.manual_seed(0)
    start = [torch.randn(s, device=CUDA) for s in [(64, 32), (32,), (128, 64)]]
    assert adamw_implementation([{"params": start}]) == {"fused": True}
    grads = [[torch.randn_like(t) for t in start] for _ in range(5)]
    results = []
    for impl in ({"foreach": True}, {"fused": True}):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **impl)
        for g in grads:
            for p, gi in zip(params, g, strict=True):
                p.grad = gi.clone()
            opt.step()
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# --- checkpoint save / resume ---------------------------------------------------------------------


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_resume_on_cuda_is_bit_exact(tmp_path, deterministic):
    """LoRA with dropout, packed and shuffled, fp32, eager attention, deterministic CUDA kernels:
    4 straight steps against 2 + resume + 2: the same losses and final adapter, bit for bit
    (the CUDA RNG state is part of the checkpoint)."""
    exact = dict(
        model__attn_implementation="eager",
        peft__method="lora",
        peft__dropout=0.1,
        peft__r=4,
        data__packing=True,
        batch__global_batch_size=4,
        batch__micro_batch_size=2,
        train__max_steps=4,
        checkpoint__every_steps=2,
    )
    ref = _run(tmp_path, "ref", **exact)
    recipe = write_recipe(tmp_path / "resumed", **exact)
    assert train_inproc(recipe, "train.max_steps=2") == 0
    assert train_inproc(recipe, "checkpoint.resume=auto") == 0
    rows = metrics(tmp_path / "resumed" / "run")
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    a = checkpoint_weights(tmp_path / "resumed/run/checkpoints/step-4")
    b = checkpoint_weights(tmp_path / "ref/run/checkpoints/step-4")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- memory planner against the CUDA allocator ----------------------------------------------------

MID_LLAMA = dict(
    TINY_LLAMA,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=4096,
    vocab_size=32000,
    max_position_embeddings=1024,
)


@pytest.mark.parametrize(
    "name, sections",
    [
        ("full-fp32", dict(model__dtype="fp32")),
        ("full-bf16", dict(model__dtype="bf16")),
        ("lora-bf16-checkpointed", dict(model__dtype="bf16", peft__method="lora", model__gradient_checkpointing=True)),
    ],
)
def test_memory_planner_within_15_percent_of_cuda_peak(tmp_path, name, sections):
    """``estimate_memory`` (without its fixed CUDA-context term, which max_memory_allocated does not
    see) against the largest ``torch.cuda.max_memory_allocated`` of a run, in its own process."""
    from llmft.plan.memory import CUDA_CONTEXT_BYTES, GIB, estimate_memory
    from llmft.plan.resolve import load_plan

    sections = dict(
        model__config=MID_LLAMA,
        model__attn_implementation="sdpa",
        data__max_seq_len=1024,
        data__packing=True,
        batch__global_batch_size=8,
        batch__micro_batch_size=4,
        train__max_steps=3,
        **sections,
    )
    write_data(tmp_path / name / "train.jsonl", n=600, kind="text")
    rows = _run_subprocess(tmp_path, name, **sections)
    measured = max(r["peak_mem_gb"] for r in rows)
    plan = load_plan(str(tmp_path / name / "recipe.yaml"), [], world_size=1)
    estimate = (estimate_memory(plan).total - CUDA_CONTEXT_BYTES) / GIB
    ratio = measured / estimate
    (tmp_path / "memory.json").write_text(json.dumps({"measured_gib": measured, "estimate_gib": estimate}))
    assert 0.85 <= ratio <= 1.15, f"{name}: measured {measured:.3f} GiB, estimate {estimate:.3f} GiB ({ratio:.2f})"
