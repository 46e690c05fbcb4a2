"""Pretrained mixtures of experts read shard by shard (llmft/model/checkpoint_keys.py, used by
llmft/model/meta.py ``SafetensorsWeights``): transformers 5's ``save_pretrained`` writes a fused
expert weight as one tensor per expert (and mixtral's modules under their old names), as the Hub's
checkpoints are; every weight read back under the model's names, whole or a range of experts,
equals what ``from_pretrained`` loads."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_pretrained
from safetensors import safe_open
from test_moe import FAMILIES

from llmft.model.checkpoint_keys import Fused
from llmft.model.meta import ParamSlots, SafetensorsWeights
from llmft.recipe.schema import Recipe


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_experts_read_from_per_expert_checkpoints_equal_from_pretrained(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = save_tiny_pretrained(tmp_path / family, seed=1, **FAMILIES[family])
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored  # the checkpoint holds one tensor per expert
    want = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    recipe = Recipe()
    recipe.model.name_or_path = str(base)
    weights = SafetensorsWeights.of(recipe, ParamSlots(model))
    fused = [k for k, v in weights.keys.items() if isinstance(v, Fused)]
    assert sorted(fused) == sorted(
        f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")
    )
    for key, param in model.state_dict().items():
        if key not in weights.keys:
            continue
        full = tuple(slice(0, n) for n in param.shape)
        torch.testing.assert_close(weights.read(key, full, param.shape), want[key], rtol=0, atol=0)
    # a range of experts, as a rank of an FSDP2 or expert-parallel run reads it
    key = "model.layers.1.mlp.experts.gate_up_proj"
    shape = want[key].shape
    part = weights.read(key, (slice(4, 8), slice(0, shape[1]), slice(0, shape[2])), shape)
    assert torch.equal(part, want[key][4:8])
    assert weights.mapped_flat(key, shape, torch.float32, 0, 8) is None  # no one range of the file holds it


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_plain_checkpoint_of_a_mixture_of_experts_reads_back_into_the_model(tmp_path, family):
    """single and DDP save with ``save_pretrained`` (one tensor per expert); resume and export read
    it back into the model's fused experts (``llmft.engines.base.read_plain``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.engines.base import read_plain

    config = AutoConfig.for_model(**FAMILIES[family])
    torch.manual_seed(0)
    trained = AutoModelForCausalLM.from_config(config)
    trained.save_pretrained(tmp_path / "step" / "model")
    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(config)
    read_plain(fresh, tmp_path / "step")
    want = trained.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
