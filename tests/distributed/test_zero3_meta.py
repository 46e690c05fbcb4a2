"""ZeRO-3 builds pretrained models partitioned (docs/design.md, G6): the model is built on the meta
device, each rank reads only its partition of every weight from the safetensors files (a 4-bit
base: quantized weight by weight, its partition of the packed bytes kept), and it is the same
model, to the bit, as the whole build.

One torchrun launch (tests/distributed/zero3_meta_probe.py) checks, on 2 ranks: ``from_pretrained``
is never called; each rank holds half of every parameter (a frozen weight read in place on a
CPU: all of it, kept whole); every gathered parameter, every buffer,
every 4-bit module's statistics and the logits equal the whole build (full fine-tune, LoRA, DoRA,
LoRA + modules_to_save, tied embeddings with uneven partitions from several bf16 files, QLoRA,
QLoRA with parameters and optimizer offloaded to the CPU, a reward model's score head, new to the
checkpoint, full and LoRA);
and 3 QLoRA steps on ZeRO-3 give the single-process losses.
"""

from __future__ import annotations

import pytest
from helpers import metrics, run_sharded_load_probe, train_inproc

pytestmark = pytest.mark.distributed

VARIANTS = [
    "full",
    "lora",
    "dora",
    "lora_save_head",
    "tied_sharded",
    "qlora",
    "qlora_offload",
    "reward_full",
    "reward_lora",
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    work = tmp_path_factory.mktemp("zero3_meta")
    return work, run_sharded_load_probe("zero3_meta_probe.py", work, VARIANTS, "ZERO3_META", timeout=600)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_partitioned_load_is_the_whole_model(probe, variant):
    r = probe[1][variant]
    assert r["from_pretrained_calls"] == 0 and r["zero_params"]
    assert 0.45 < r["local_fraction"] < 0.55  # this rank's half of every tensor, no more
    assert r["param_diff"] == 0.0, r["worst_param"]  # bit for bit, in the dtype each one is kept in
    assert r["buffer_diff"] == 0.0  # rotary inv_freq recomputed
    assert r["logits_diff"] < 1e-6
    assert r["same_rng_after"]


def test_a_cpu_peft_runs_frozen_weights_are_the_weight_files_pages_kept_whole(probe):
    """On a CPU a frozen weight stored in the run's dtype is not copied: it is partitioned over a
    group of the rank alone, its one partition the whole weight as the safetensors file's own pages,
    so no rank gathers it from another. Not so: a full fine-tune's (trained), bf16 files under an
    fp32 run (tied_sharded), offloaded partitions (DeepSpeed's own CPU buffers), 4-bit weights."""
    report = probe[1]
    for variant in ("lora", "dora", "lora_save_head", "qlora"):
        r = report[variant]
        assert len(r["frozen_mapped"]) == r["frozen"] > 0, variant
        assert r["kept_whole"] == r["frozen_mapped"], variant
    # the score head the checkpoint lacks gets its seeded init: a copy, partitioned
    r = report["reward_lora"]
    assert (
        len(r["frozen_mapped"]) == r["frozen"] - 1
        and "base_model.model.score.original_module.weight" not in r["frozen_mapped"]
        and r["kept_whole"] == r["frozen_mapped"]
    )
    for variant in ("tied_sharded", "qlora_offload", "full", "reward_full"):
        assert report[variant]["frozen_mapped"] == report[variant]["kept_whole"] == [], variant
    assert report["tied_sharded"]["frozen"] > 0 and report["qlora_offload"]["frozen"] > 0
    assert report["full"]["frozen"] == report["reward_full"]["frozen"] == 0


def test_the_planner_counts_what_zero3_keeps_beside_the_partitions(probe):
    """DeepSpeed ZeRO-3 keeps an fp32 master copy of the trained partition even in an fp32 run
    (it shares the partition only when a torch.device equals a device-name string), and keeps the
    trained parameters under ``stage3_param_persistence_threshold`` whole on every rank. The
    planner's ``master_weights`` and persistent adapters are those bytes, read from the engine."""
    report = probe[1]
    for variant in ("lora", "dora", "qlora"):
        r = report[variant]
        assert r["master_bytes"] > 0 and r["persistent_trained_bytes"] > 0, variant
        assert r["planned_master_bytes"] == pytest.approx(r["master_bytes"], rel=0.02), variant
        held = r["partition_bytes"] + r["persistent_trained_bytes"]
        assert r["planned_adapter_bytes"] == pytest.approx(held, rel=0.02), variant
    # offloaded, the partitions are host memory and the persistent tensors stay whole on the device
    r = report["qlora_offload"]
    assert r["planned_adapter_bytes"] == r["persistent_trained_bytes"] > 0


def test_zero3_4bit_load_has_the_whole_builds_statistics(probe):
    r = probe[1]["qlora"]
    assert r["num_4bit"] == 14  # 7 linear layers in each of 2 decoder layers
    assert r["quant_state_equal"]


def test_three_zero3_qlora_steps_on_a_partitioned_4bit_load_match_single_process(probe, tmp_path):
    work, report = probe
    assert report["train"] == {"code": 0, "from_pretrained_calls": 0}
    single = train_inproc(
        work / "pretrained" / "recipe.yaml",
        "peft.method=lora",
        "peft.r=4",
        "model.quantization={bits: 4}",
        "train.max_steps=3",
        f"run.output_dir={tmp_path / 'single'}",
    )
    assert single == 0
    ref, got = metrics(tmp_path / "single"), metrics(work / "zero3")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    for a, b in zip(got, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, a["step"]
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, a["step"]
