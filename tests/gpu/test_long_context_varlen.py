"""Long context on CUDA: flash-attention varlen (and torch's varlen_sdpa) over long packed rows, and
DeepSpeed's Ulysses attention (UlyssesSPAttentionHF around flash_attention_2) against one process.
Marked ``gpu`` and skipped without CUDA (tests/conftest.py) or without flash-attn.

These check DeepSpeed and the data path alone, not llmft's ``distributed.sequence_parallel`` (the
"sp" branch tests that through the engines); tolerances are bf16's (flash attention runs in bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, TINY_LLAMA, torchrun_cmd

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
LONG = 1 << 17  # 131,072 tokens: the bench's long-context row


@pytest.mark.parametrize("attn", ["flash_attention_2", "varlen_sdpa"])
def test_flash_varlen_on_a_128k_packed_row_equals_each_document_alone(attn):
    """A 128K-token row packed by the cache's code and collated as training collates it: flash
    attention's varlen kernel (boundaries from the position ids), or torch's sdpa per document
    (varlen_sdpa, what ``auto`` picks without flash-attn), gives every document the token losses
    it has alone, within bf16 rounding."""
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.model import attention, kernels

    attention.register()

    from llmft.data import collate
    from llmft.data.encode import Example
    from llmft.data.pack import pack
    from llmft.data.tokens import TokenDataset

    rng = np.random.default_rng(0)
    lengths = [60_000, 1, 25_000, 40_000, 6_071]  # fill the 131,072 tokens exactly; one is a single token
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in lengths]
    dataset = TokenDataset(pack([Example(d, d) for d in docs], LONG, 0))
    assert len(dataset) == 1
    row = {k: v.to(CUDA) for k, v in collate([dataset[0]], 0).items()}
    assert row["input_ids"].shape == (1, LONG) and row["position_ids"].dtype == torch.int64

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY_LLAMA, "max_position_embeddings": LONG})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    model.to(CUDA).eval()
    kernels.pass_packed_boundaries(model)  # as the loop does for varlen attention
    with torch.no_grad():
        logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits.float()
        at = 0
        for doc in docs:
            n = len(doc)
            if n > 1:
                alone = model(input_ids=torch.from_numpy(doc.astype(np.int64))[None].to(CUDA), use_cache=False)
                want = alone.logits.float()[0]
                got = logits[0, at : at + n]
                assert (got - want).abs().max() <= 2e-2 * want.abs().max(), (n, at)
            at += n
        # The whole row's loss counts every target once (the first token of each document is none).
        labels = row["labels"][0, 1:]
        assert int((labels != -100).sum()) == sum(lengths) - len(lengths)
        assert torch.isfinite(F.cross_entropy(logits[0, :-1], labels, ignore_index=-100))


def test_ulysses_flash_attention_on_a_packed_row_equals_one_process(tmp_path: Path):
    """Two ranks with DeepSpeed's Ulysses attention over flash_attention_2 (sp 2), each holding
    half of a packed row whose third sequence crosses the cut, give the logits and the gradients
    of one process running the whole row: within bf16 rounding (the all-to-all moves heads, the
    kernels and the math are the same)."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")
    out = tmp_path / "ulysses.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    probe = str(Path(__file__).with_name("ulysses_probe.py"))
    done = subprocess.run(
        [*torchrun_cmd(2), probe, str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["logits_rel"] <= 2e-2, result
    assert result["grad_rel"] <= 5e-2, result
