"""model.activation_offload and model.tiled_mlp on CUDA (docs/long-context.md): what a CPU cannot
show, the device memory that offload and tiling take away, and the planner beside it. Marked
``gpu``, skipped without CUDA (tests/conftest.py):

    pytest -q -m gpu tests/gpu/test_long_context_gpu.py

A Llama of 8 layers, hidden 512, MLP 1536 (so that its activations, not its 30 MB of weights,
dominate at 8K tokens), bf16, one sequence per micro-step, gradient checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from helpers import write_recipe

from llmft.data.tokenizer import byte_tokenizer
from llmft.engines import autocast_for
from llmft.model.build import prepare_model
from llmft.plan.memory import estimate_memory
from llmft.plan.resolve import load_plan

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MODEL = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1536,
    "vocab_size": 320,
    "max_position_embeddings": 8192,
}
SEQ = 8192
BASE = [
    "model.dtype=bf16",
    "model.attn_implementation=sdpa",
    "model.gradient_checkpointing=true",
    f"data.max_seq_len={SEQ}",
    "batch.global_batch_size=1",
    "batch.micro_batch_size=1",
]


def step_peak(tmp_path, *overrides: str) -> tuple[int, int]:
    """Peak bytes torch allocates on the GPU during one forward + backward above what was allocated
    before it, and the planner's activations + logits for the same recipe."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    plan = load_plan(str(write_recipe(tmp_path, model__config=MODEL)), [*BASE, *overrides], world_size=1)
    torch.manual_seed(0)
    model = prepare_model(plan, byte_tokenizer(), CUDA)
    ids = torch.randint(0, 256, (1, SEQ), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    for _ in range(2):  # the first step allocates the gradients; measure the second
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with autocast_for(torch.bfloat16, CUDA):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
    est = estimate_memory(plan)
    return torch.cuda.max_memory_allocated() - before, est.activations + est.logits


def test_offload_takes_the_checkpointed_inputs_off_the_gpu(tmp_path):
    kept, _ = step_peak(tmp_path / "kept")
    offloaded, planned = step_peak(tmp_path / "offloaded", "model.activation_offload=true")
    inputs = MODEL["num_hidden_layers"] * SEQ * MODEL["hidden_size"] * 2  # bf16 layer inputs
    # All but the one being recomputed leave the GPU (the embedding output, layer 0's input, too).
    assert kept - offloaded >= 0.8 * inputs, (kept, offloaded, inputs)
    assert 0.85 <= offloaded / planned <= 1.15, (offloaded, planned)


def test_tiled_mlp_bounds_the_mlp_intermediates(tmp_path):
    plain, _ = step_peak(tmp_path / "plain")
    tiled, planned = step_peak(tmp_path / "tiled", "model.tiled_mlp=true")
    # The recomputed layer's MLP keeps 4 x tokens x intermediate bf16 values untiled, one tile's tiled.
    mlp = 4 * SEQ * MODEL["intermediate_size"] * 2
    assert plain - tiled >= 0.5 * mlp, (plain, tiled, mlp)
    assert 0.85 <= tiled / planned <= 1.15, (tiled, planned)
