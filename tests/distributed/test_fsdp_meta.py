"""FSDP2 builds big models sharded (docs/design.md, G6): a pretrained model is built on the meta device,
sharded, and loaded shard by shard from its safetensors files, and it is the same model, to the
bit, as the one every other engine builds whole.

One torchrun launch (tests/distributed/fsdp_meta_probe.py) checks, on 2 ranks: every tensor is
still on the meta device when ``fully_shard`` runs and ``from_pretrained`` is never called;
each rank holds about half the parameters; every gathered parameter, every buffer and the logits
equal the whole-model build (full fine-tune, LoRA, DoRA in bf16, LoRA + modules_to_save, tied
embeddings with uneven shards from several weight files, a 4-bit QLoRA base quantized weight by
weight into each rank's packed shard, a reward model's score head, new to the checkpoint, full and
LoRA); a fresh model above the size threshold
gets a seeded init that differs between shards; and 2 training steps give the single-process losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    metrics,
    pretrained_model,
    run_sharded_load_probe,
    save_tiny_pretrained,
    torchrun,
    train_inproc,
    write_recipe,
)

pytestmark = pytest.mark.distributed

VARIANTS = [
    "full",
    "lora",
    "dora_bf16",
    "lora_save_head",
    "tied_sharded",
    "fresh_big",
    "qlora",
    "reward_full",
    "reward_lora",
]


# On a CPU each decoder layer is 3 units (attention, MLP, the layer's norms), + the root, + the
# embedding and the head, each a unit unless tied (in the root), absent (a score model's head) or
# frozen in the run's dtype in the file: then every rank maps it whole, unsharded (MAPPED_WHOLE).
BOTH = ["model.embed_tokens.weight", "lm_head.weight"]
VOCAB_UNITS = {
    "full": BOTH,
    "lora": [],
    "dora_bf16": BOTH,  # stored fp32, run in bf16
    "lora_save_head": ["lm_head.weight"],  # the trained copy and its frozen original
    "tied_sharded": [],
    "fresh_big": BOTH,
    "qlora": [],
    "reward_full": BOTH[:1],
    "reward_lora": [],
}
MAPPED_WHOLE = {"lora": BOTH, "lora_save_head": BOTH[:1], "qlora": BOTH, "reward_lora": BOTH[:1]}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The one launch: builds, compares and trains on 2 ranks. Returns (workdir, report)."""
    work = tmp_path_factory.mktemp("fsdp_meta")
    write_recipe(work / "fresh")
    return work, run_sharded_load_probe("fsdp_meta_probe.py", work, VARIANTS, "FSDP_META", timeout=500)


@pytest.mark.parametrize("variant", VARIANTS)
def test_meta_build_never_holds_the_whole_model(probe, variant):
    r = probe[1][variant]
    assert r["meta_at_fully_shard"]
    assert r["num_fully_shard"] == 2 * 3 + len(VOCAB_UNITS[variant]) + 1, r["num_fully_shard"]
    assert r["whole"] == sorted(f"base_model.model.{n}" for n in MAPPED_WHOLE.get(variant, []))
    assert r["from_pretrained_calls"] == 0
    assert 0.45 < r["local_fraction"] < 0.55  # this rank's half of every tensor, no more


# Frozen weights stored in the dtype they are used in are mapped: LoRA's base, a QLoRA base's
# embedding, norms and head (its 4-bit weights are quantized), a reward model's frozen base. Copied:
# weights stored in another dtype (tied_sharded's files are bf16, its run fp32; dora_bf16 the
# other way), a fresh model (no file) and a score head the checkpoint lacks (seeded inits); a full
# fine-tune freezes nothing.
COPIED = {
    "tied_sharded": "all",
    "dora_bf16": "all",
    "fresh_big": "all",
    "reward_lora": ["base_model.model.score.original_module.weight"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_cpu_runs_frozen_shards_are_the_weight_files_pages(probe, variant):
    """On a CPU the frozen base is not copied: each rank's rows of it are the safetensors file's
    own pages (shared through the page cache, as from_pretrained leaves a CPU model's weights)."""
    r = probe[1][variant]
    copied = COPIED.get(variant, [])
    assert r["frozen_copied"] == (sorted(r["frozen_copied"]) if copied == "all" else copied)
    if copied == "all":
        assert len(r["frozen_copied"]) == r["frozen"] > 0
    assert r["frozen"] > 0 or variant in ("full", "reward_full")


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "fresh_big"])
def test_sharded_load_is_the_whole_model(probe, variant):
    r = probe[1][variant]
    assert r["param_diff"] == 0.0, r["worst_param"]  # bit for bit, in the dtype each one is kept in
    assert r["buffer_diff"] == 0.0  # rotary inv_freq recomputed
    if not variant.endswith("bf16"):  # in bf16, FSDP's mixed precision computes otherwise than the plain model
        assert r["logits_diff"] < 1e-6
    assert r["same_rng_after"]  # data order and dropout see the same global RNG as a whole build


def test_sharded_4bit_load_is_the_whole_4bit_build(probe):
    """QLoRA: each rank quantizes the weights one at a time and keeps its part of the packed bytes;
    the packed bytes (gathered) and every module's quantization statistics equal the whole build's
    to the bit (checked in test_sharded_load_is_the_whole_model / here), and so do the logits."""
    r = probe[1]["qlora"]
    assert r["num_4bit"] == 14  # 7 linear layers in each of 2 decoder layers
    assert r["quant_state_equal"]


def test_fresh_big_model_gets_a_seeded_sharded_init(probe):
    r = probe[1]["fresh_big"]
    assert r["rebuild_diff"] == 0.0  # deterministic by run.seed
    assert r["shards_differ"]  # each rank's rows come from one full-size draw, not a per-rank copy
    assert all(0.015 < s < 0.025 for s in r["matrix_std"])  # _init_weights: normal(0, initializer_range=0.02)
    assert r["buffer_diff"] == 0.0 and r["adapter_diff"] == 0.0 and r["logits_finite"]
    assert r["param_diff"] > 0  # documented: not the single-process init


def test_two_fsdp_steps_match_single_process(probe, tmp_path):
    work, report = probe
    assert report["train"] == {"code": 0, "meta_at_fully_shard": True, "from_pretrained_calls": 0}
    single = train_inproc(
        work / "pretrained" / "recipe.yaml", "distributed.engine=single", f"run.output_dir={tmp_path / 'single'}"
    )
    assert single == 0
    ref, got = metrics(tmp_path / "single"), metrics(work / "fsdp")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    assert abs(got[0]["loss"] - ref[0]["loss"]) < 1e-5
    assert abs(got[1]["loss"] - ref[1]["loss"]) < 1e-4


@pytest.mark.slow
def test_two_fsdp_lora_steps_match_single_process(tmp_path):
    """Adapters drawn from run.seed, not the global RNG: after one update the engines still agree."""
    hf = save_tiny_pretrained(tmp_path / "hf", seed=4)
    recipe = write_recipe(tmp_path, model=pretrained_model(hf), peft={"method": "lora", "r": 4})
    done = torchrun(["train", str(recipe), "distributed.engine=fsdp", "batch.micro_batch_size=2"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert train_inproc(recipe, "distributed.engine=single", f"run.output_dir={tmp_path / 'single'}") == 0
    ref, got = metrics(tmp_path / "single"), metrics(tmp_path / "run")
    assert abs(got[0]["loss"] - ref[0]["loss"]) < 1e-5
    assert abs(got[0]["grad_norm"] - ref[0]["grad_norm"]) < 1e-4  # the adapters' gradients depend on A
    assert abs(got[1]["loss"] - ref[1]["loss"]) < 1e-4


@pytest.mark.slow
def test_three_fsdp_qlora_steps_on_a_sharded_4bit_load_match_single_process(tmp_path):
    """A pretrained QLoRA base loaded shard by shard trains like the single process's whole build
    (bitsandbytes finds each module's statistics once FSDP has gathered the packed bytes)."""
    hf = save_tiny_pretrained(tmp_path / "hf", seed=5)
    recipe = write_recipe(
        tmp_path,
        model={**pretrained_model(hf), "quantization": {"bits": 4}},
        peft={"method": "lora", "r": 4},
        train__max_steps=3,
    )
    done = torchrun(["train", str(recipe), "distributed.engine=fsdp", "batch.micro_batch_size=2"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert train_inproc(recipe, "distributed.engine=single", f"run.output_dir={tmp_path / 'single'}") == 0
    ref, got = metrics(tmp_path / "single"), metrics(tmp_path / "run")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    for a, b in zip(got, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, a["step"]
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, a["step"]


# --- in-process: names and user errors of the sharded load (no launch) --------------------------


@pytest.mark.parametrize(
    "name,key",
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight", None),
        ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
        ("base_model.model.lm_head.original_module.weight", "lm_head.weight"),
    ],
)
def test_base_key(name, key):
    from llmft.model.adapters import base_key

    assert base_key(name) == key


def test_base_key_of_the_frozen_base():
    """Export's view: a trained modules_to_save copy is not part of the frozen base; the original is."""
    from llmft.model.adapters import base_key

    assert base_key("lm_head.modules_to_save.default.weight", trained_copies=False) is None
    assert base_key("lm_head.original_module.weight", trained_copies=False) == "lm_head.weight"
    assert base_key("model.layers.0.mlp.up_proj.lora_B.default.weight", trained_copies=False) is None


def _meta_slots(recipe_path: Path):
    from llmft.model.build import build_model
    from llmft.model.meta import ParamSlots
    from llmft.recipe import load_recipe

    recipe = load_recipe(str(recipe_path), [])
    model = build_model(recipe, None, init_context=lambda: torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    return recipe, ParamSlots(model)


def test_weights_the_model_lacks_are_a_user_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from llmft.errors import UserError
    from llmft.model.meta import SafetensorsWeights

    hf = save_tiny_pretrained(tmp_path / "hf", seed=3)
    state = load_file(hf / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    recipe, slots = _meta_slots(write_recipe(tmp_path, model=pretrained_model(hf)))
    with pytest.raises(UserError) as e:
        SafetensorsWeights.of(recipe, slots)
    assert "model.name_or_path" in str(e.value) and "model.layers.1.mlp.up_proj.weight" in str(e.value)


def test_weights_without_safetensors_are_a_user_error(tmp_path):
    from llmft.errors import UserError
    from llmft.model.meta import SafetensorsWeights

    hf = save_tiny_pretrained(tmp_path / "hf", seed=3)
    (hf / "model.safetensors").rename(hf / "weights.bin")
    recipe, slots = _meta_slots(write_recipe(tmp_path, model=pretrained_model(hf)))
    with pytest.raises(UserError, match="no model.safetensors or model.safetensors.index.json"):
        SafetensorsWeights.of(recipe, slots)
