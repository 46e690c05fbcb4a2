"""`llmft export` of sharded checkpoints: ZeRO-3 and FSDP2, full fine-tune and LoRA.

Two ranks train 2 steps; `llmft export RUN --out D` (and `--merge-lora` for LoRA) writes a
Hugging Face directory that `from_pretrained` (and `PeftModel.from_pretrained` for the
adapter) loads with the logits of the consolidated checkpoint
(`llmft.export.consolidate.load_checkpoint_model`). Neither engine holds the whole model on one
rank, so a model.config base is not saved by training: export rebuilds it from the seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, torchrun, write_recipe
from transformers import AutoModelForCausalLM

from llmft.data.tokenizer import byte_tokenizer
from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ENGINES = {
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=2"],
    "fsdp": ["distributed.engine=fsdp", "batch.micro_batch_size=2"],
}
LORA = ["peft.method=lora", "peft.r=4", "peft.alpha=8"]
QLORA = [*LORA, "model.quantization={bits: 4}"]
KINDS = {"full": [], "lora": LORA, "qlora": QLORA}
TEXT = ["<|user|>\nreverse abc<|end|><|assistant|>\ncba", "<|user|>\nreverse xyz<|end|><|assistant|>\nzyx"]


def _export(run_dir: Path, out: Path, *flags: str) -> Path:
    cmd = [sys.executable, "-m", "llmft", "export", str(run_dir), "--out", str(out), *flags]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-4000:]
    names = {p.name for p in out.iterdir()}
    assert "tokenizer.json" in names and not any(n.endswith((".bin", ".pt", ".pth")) for n in names), names
    return out


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits.float()


def _same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# CI: full on FSDP2, QLoRA (LoRA on a 4-bit base) on both; ``-m extended`` the other three.
EXTENDED = {("fsdp", "lora"), ("zero3", "full"), ("zero3", "lora")}


@pytest.mark.parametrize(
    "engine,kind",
    [
        pytest.param(e, k, marks=pytest.mark.extended) if (e, k) in EXTENDED else (e, k)
        for e in sorted(ENGINES)
        for k in sorted(KINDS)
    ],
    ids=[f"{e}-{k}" for e in sorted(ENGINES) for k in sorted(KINDS)],
)
def test_export_round_trip(tmp_path, engine, kind):
    """QLoRA: the adapter trained on the NF4 base; exported, it goes with the unquantized base
    (merged into it, or beside it), which is what the consolidated checkpoint model is too."""
    recipe = write_recipe(tmp_path)
    lora = kind != "full"
    done = torchrun(["train", str(recipe), "train.max_steps=2", *ENGINES[engine], *KINDS[kind]])
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "run"
    assert not (run / "checkpoints/base_model").exists()  # sharded: the base is rebuilt at export

    consolidated, *_ = load_checkpoint_model(run)
    ids = byte_tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    want = _logits(consolidated, ids)

    if not lora:
        model = AutoModelForCausalLM.from_pretrained(_export(run, tmp_path / "full"), attn_implementation="eager")
        assert model.dtype == torch.float32
        _same_logits(_logits(model, ids), want)
        _streamed_full_export_equals_the_consolidated_model(run, tmp_path / "streamed", consolidated)
        return

    from peft import PeftModel

    with torch.no_grad(), consolidated.disable_adapter():
        assert (_logits(consolidated, ids) - want).abs().max() > 1e-3  # the adapter trained: a real check
    # what the adapter export loads: the adapter alone, the frozen base never given memory
    adapter_only, *_ = load_checkpoint_model(run, adapter_only=True)
    assert all(p.is_meta for p in adapter_only.parameters() if not p.requires_grad)
    got, expected = trainable_state(adapter_only), trainable_state(consolidated)
    assert got.keys() == expected.keys() and got
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    adapter = _export(run, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_dir == str((adapter / "base_model").resolve())
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    _same_logits(_logits(PeftModel.from_pretrained(base, adapter), ids), want)

    merged = _export(run, tmp_path / "merged", "--merge-lora")
    assert not (merged / "adapter_config.json").exists()
    _same_logits(_logits(AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager"), ids), want)


def _streamed_full_export_equals_the_consolidated_model(run: Path, out: Path, consolidated: torch.nn.Module) -> None:
    """The full export streams the sharded state (DCP key subsets / zero_to_fp32 per parameter) into
    weight files: here in-process, with consolidation forbidden and files of ~40 kB, so that it
    writes several; every weight equals the consolidated model's to the bit, and it loads."""
    from unittest import mock

    from safetensors.torch import load_file

    import llmft.export.consolidate
    import llmft.export.export

    def forbidden(*args, **kwargs):
        raise AssertionError("a full fine-tune export must not consolidate the whole model")

    with (
        mock.patch.object(llmft.export.consolidate, "load_checkpoint_model", forbidden),
        mock.patch.object(llmft.export.export, "EXPORT_SHARD_BYTES", 40_000),
    ):
        llmft.export.export.export(run, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3, files
    written = {k: v for f in files for k, v in load_file(out / f).items()}
    want = {k: v for k, v in consolidated.state_dict().items() if k != "lm_head.weight" or k in written}
    assert written.keys() == want.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
    AutoModelForCausalLM.from_pretrained(out)
