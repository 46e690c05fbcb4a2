"""``distributed.sequence_parallel: 2`` on 2 ranks against one process with the whole sequence
(docs/long-context.md): the same gradient (<= 1e-5 relative) and the same weights
after a few SGD steps, on DDP, FSDP2, ZeRO-2 and ZeRO-3, full fine-tuning and LoRA, packed and
unpacked rows, an odd row length, a GQA model with one KV head (replicated to both ranks); varlen_sdpa
(``model.attn_implementation: auto`` for packed rows) against sdpa's masked rows; two
sequence groups and sp 4 on 4 ranks; dpo, a reward model and a precomputed reference; resume;
the chunked loss.

The gradient of the first step is read from the weights: plain SGD without clipping moves them by
``-lr x gradient``, so ``|w_sp - w_one| / |w_0 - w_one|`` is the gradients' relative difference."""

from __future__ import annotations

import pytest
import torch
from helpers import metrics, sample_log, torchrun, train_inproc, write_recipe

from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _cases(names, extended: set[str]) -> list:
    """Parameters, the ``extended`` ones marked so: CI runs the covering set (every engine, full and
    LoRA, packed and unpacked, odd length, GQA, clipping), ``-m extended`` the other combinations."""
    return [pytest.param(n, marks=pytest.mark.extended) if n in extended else n for n in names]


SGD = ["optim.name=sgd", "optim.lr=0.5", "optim.max_grad_norm=null", "train.max_steps=3", "checkpoint.every_steps=1"]
SP2 = ["distributed.sequence_parallel=2", "batch.micro_batch_size=2"]  # accumulation 2, one sequence group
FSDP = ["distributed.engine=fsdp"]
ZERO3 = ["distributed.engine=deepspeed", "distributed.zero_stage=3"]
LORA = ["peft.method=lora"]
PACKED_ODD = ["data.packing=true", "data.max_seq_len=63"]  # rows of 63 tokens: padded to 64, 32 per rank
GQA_1KV = ["model.config.num_key_value_heads=1"]

CASES = {
    "fsdp_full_unpacked": FSDP,
    "fsdp_lora_packed_odd": FSDP + LORA + PACKED_ODD,
    "fsdp_full_packed_gqa1": FSDP + GQA_1KV + ["data.packing=true"],
    "zero3_full_packed_odd": ZERO3 + PACKED_ODD,
    "zero3_lora_unpacked_gqa1": ZERO3 + LORA + GQA_1KV,
    "zero2_full_packed": ["distributed.engine=deepspeed", "distributed.zero_stage=2", "data.packing=true"],
    "ddp_lora_packed_odd": ["distributed.engine=ddp"] + LORA + PACKED_ODD,
    "ddp_full_unpacked_gqa1": ["distributed.engine=ddp"] + GQA_1KV,
    # Clipping sees the true gradient norm: the clipped steps are the same.
    "fsdp_full_clipped": FSDP + ["optim.max_grad_norm=0.5"],
    "zero3_full_clipped": ZERO3 + ["optim.max_grad_norm=0.5"],
}


def _state(path) -> dict[str, torch.Tensor]:
    model, *_ = load_checkpoint_model(path)
    return trainable_state(model)


def _initial(recipe, overrides: list[str]) -> dict[str, torch.Tensor]:
    """The weights both runs start from: the seeded build of one process."""
    from llmft.data.tokenizer import load_tokenizer
    from llmft.model.build import prepare_model
    from llmft.plan.resolve import load_plan

    plan = load_plan(recipe, [*overrides, "distributed.engine=single"])
    return trainable_state(prepare_model(plan, load_tokenizer(plan.recipe.model), torch.device("cpu")))


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))


@pytest.mark.parametrize(
    "case",
    _cases(CASES, {"fsdp_full_packed_gqa1", "zero2_full_packed", "ddp_full_unpacked_gqa1", "fsdp_full_clipped"}),
)
def test_sequence_parallel_2_matches_one_process(tmp_path, case):
    _matches_one_process(tmp_path, CASES[case], SP2, nproc=2)


# Two sequence groups of 2 (dp 2 x sp 2): the sampler deals by group, and the engines' divisors
# (DDP and FSDP2 world, ZeRO-2 world / N, ZeRO-3 world) are told apart, as they are not with dp 1.
GROUPS = {
    "ddp": ["distributed.engine=ddp"],
    "fsdp": FSDP,
    "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2"],
    "zero3": ZERO3 + ["data.packing=true"],
    # HSDP: 2 replicas x 2 shards, each shard group one sequence group (ranks 0-1 and 2-3); LoRA
    # packed rows of odd length.
    "hsdp": FSDP + ["distributed.hsdp_replicate=2"] + LORA + PACKED_ODD,
}


@pytest.mark.parametrize("case", _cases(GROUPS, {"ddp", "fsdp", "hsdp"}))  # ZeRO-2 and ZeRO-3 divide differently
def test_two_sequence_groups_on_4_ranks_match_one_process(tmp_path, case):
    _matches_one_process(
        tmp_path, GROUPS[case], ["distributed.sequence_parallel=2", "batch.micro_batch_size=1"], nproc=4
    )


def test_sequence_parallel_4_replicates_kv_heads_and_matches_one_process(tmp_path):
    """sp 4 on 4 ranks: 4 query heads, one each; 2 KV heads, each replicated to 2 ranks (ALST);
    packed rows of odd length 63, padded to 64 (16 tokens per rank)."""
    keys = ["distributed.sequence_parallel=4", "batch.micro_batch_size=2"]
    _matches_one_process(tmp_path, FSDP + PACKED_ODD, keys, nproc=4)


@pytest.mark.parametrize("engine", _cases(["ddp", "zero3"], {"zero3"}))
def test_varlen_sdpa_sequence_parallel_matches_one_process_sdpa(tmp_path, engine):
    """sp 2 on 2 ranks with model.attn_implementation=auto (varlen_sdpa here: each example of the
    whole packed row on its own, llmft/model/attention.py) against one process with sdpa's
    block-diagonal mask: packed rows of odd length, a GQA model with one KV head."""
    overrides = {"ddp": ["distributed.engine=ddp"], "zero3": ZERO3}[engine] + PACKED_ODD + GQA_1KV
    _matches_one_process(tmp_path, overrides, [*SP2, "model.attn_implementation=auto"], nproc=2)


def _matches_one_process(tmp_path, overrides: list[str], sp_keys: list[str], nproc: int) -> None:
    common = [o for o in overrides if not o.startswith("distributed.")]
    recipe = write_recipe(
        tmp_path, model__attn_implementation="sdpa", batch__global_batch_size=4, batch__micro_batch_size=4
    )
    common.append(f"data.eval={tmp_path / 'train.jsonl'}")  # the final eval runs sequence-parallel too
    one = tmp_path / "one"
    assert train_inproc(recipe, *SGD, *common, "distributed.engine=single", f"run.output_dir={one}") == 0
    sp = tmp_path / "sp"
    args = ["train", str(recipe), *SGD, *overrides, *sp_keys, common[-1], f"run.output_dir={sp}"]
    done = torchrun(args, nproc=nproc, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]

    w0 = _initial(recipe, common[:-1])
    w1_one, w1_sp = _state(one / "checkpoints/step-1"), _state(sp / "checkpoints/step-1")
    step = {k: w0[k] - w1_one[k] for k in w0}
    diff = {k: w1_sp[k] - w1_one[k] for k in w0}
    assert _norm(step) > 0
    assert _norm(diff) / _norm(step) <= 1e-5  # the first step's gradients
    w3_one, w3_sp = _state(one), _state(sp)
    assert max(float((w3_sp[k] - w3_one[k]).abs().max() / w3_one[k].abs().max().clamp_min(1e-12)) for k in w0) <= 1e-5
    rows, ref = metrics(sp), metrics(one)
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]  # each target token counted once
    assert all(abs(r["loss"] - q["loss"]) <= 1e-5 * abs(q["loss"]) for r, q in zip(rows, ref, strict=True))
    assert all(abs(r["grad_norm"] - q["grad_norm"]) <= 1e-5 * q["grad_norm"] for r, q in zip(rows, ref, strict=True))
    _eval_matches(sp, one)


def test_slices_equal_deepspeeds_dataloader_adapter():
    """llmft slices each micro-batch itself (the adapter reorders samples across micro-steps:
    llmft/data/sequence.py); the slices are the adapter's (tests/distributed/sp_slices_probe.py)."""
    import os
    import subprocess

    from helpers import ROOT, torchrun_cmd

    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed/sp_slices_probe.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "SLICES_MATCH packed unpacked" in done.stdout


def _eval_matches(sp, one) -> None:
    (mine,), (ref,) = metrics(sp, "eval"), metrics(one, "eval")
    assert mine["tokens"] == ref["tokens"] and abs(mine["loss"] - ref["loss"]) <= 1e-5 * ref["loss"]


def _write_pairs(path, n: int = 24) -> None:
    import json
    import random

    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 30)))
            rec = {"prompt": f"reverse {word}:", "chosen": word[::-1], "rejected": word[: rng.randint(1, len(word))]}
            f.write(json.dumps(rec) + "\n")


PADDING_FREE = ["data.packing=true"]
# (objective, overrides): DPO on every sharding engine; a reward model (each score is its
# sequence's last token, in one slice); a precomputed reference scored by the sequence groups
# (ipo: the per-token means divide by the groups' summed target counts).
PREFERENCE_CASES = {
    "dpo_fsdp_full_unpacked": ("dpo", FSDP),
    "dpo_fsdp_lora_padding_free": ("dpo", FSDP + LORA + PADDING_FREE),
    "dpo_zero3_lora_unpacked": ("dpo", ZERO3 + LORA),
    "reward_fsdp_lora_padding_free": ("reward", FSDP + LORA + PADDING_FREE),
    "reward_zero3_full_unpacked": ("reward", ZERO3),
    "ipo_precomputed_zero3_lora_padding_free": (
        "dpo",
        ZERO3 + LORA + PADDING_FREE + ["preference.loss_type=ipo", "preference.precompute_reference=true"],
    ),
}


@pytest.mark.parametrize("case", _cases(PREFERENCE_CASES, {"dpo_fsdp_full_unpacked", "reward_fsdp_lora_padding_free"}))
def test_preference_sequence_parallel_2_matches_one_process(tmp_path, case):
    """Pairs of sequences split over 2 ranks: per-sequence log-prob sums (dpo) or last-token scores
    (reward) are summed over the group with their gradients, each pair is counted once; 2 SGD
    steps (the second one away from the reference) equal one process's. Each run has its own data
    cache, so a precomputed reference is computed by its own run (sequence groups, or one process)."""
    objective, overrides = PREFERENCE_CASES[case]
    pairs = tmp_path / "pairs.jsonl"
    _write_pairs(pairs)
    recipe = write_recipe(
        tmp_path,
        model__attn_implementation="sdpa",
        batch__global_batch_size=4,
        batch__micro_batch_size=4,
        data__train=str(pairs),
        train__objective=objective,
    )
    sgd = ["optim.name=sgd", "optim.lr=0.5", "optim.max_grad_norm=null", "train.max_steps=2"]
    common = [o for o in overrides if not o.startswith("distributed.")]
    one, sp = tmp_path / "one", tmp_path / "sp"
    solo = [*sgd, *common, "distributed.engine=single", f"run.output_dir={one}", f"data.cache_dir={tmp_path / 'c1'}"]
    assert train_inproc(recipe, *solo) == 0
    args = ["train", str(recipe), *sgd, *overrides, *SP2, f"run.output_dir={sp}", f"data.cache_dir={tmp_path / 'c2'}"]
    done = torchrun(args, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    if "preference.precompute_reference=true" in overrides:
        assert "reference log-probs: computed 24 pairs on 2 rank(s)" in done.stderr
    w_one, w_sp = _state(one), _state(sp)
    w0 = _initial(recipe, common)
    moved = {k: w0[k] - w_one[k] for k in w0}
    assert _norm(moved) > 0 and _norm({k: w_sp[k] - w_one[k] for k in w0}) / _norm(moved) <= 1e-5
    rows, ref = metrics(sp), metrics(one)
    assert len(rows) == len(ref) == 2
    for r, q in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm", "rewards/margin", "rewards/chosen", "logps/chosen"):
            if key in q:  # (at step 1 a margin is 0 up to rounding: 1e-7 absolute)
                assert abs(r[key] - q[key]) <= 1e-5 * max(abs(q[key]), 1e-2), (key, r[key], q[key])


@pytest.mark.parametrize("engine", _cases(["fsdp", "zero3"], {"zero3"}))
def test_resume_exact_and_elastic_from_sp2_to_sp1_keeps_the_sample_position(tmp_path, engine):
    """An sp 2 run stopped at step 2 (its checkpoint) and resumed to step 4: on 2 ranks with sp 2
    (exact) and on 1 rank with sp 1 (elastic: the same global batch, accumulation 2 -> 2 with the
    micro-batch of the whole group). Against the uninterrupted sp 2 run: per step the same samples
    (LLMFT_SAMPLE_LOG, a group's ranks log the same ones), the same losses and final weights."""
    recipe = write_recipe(
        tmp_path, model__attn_implementation="sdpa", batch__global_batch_size=4, batch__micro_batch_size=2
    )
    keys = [*(FSDP if engine == "fsdp" else ZERO3), "checkpoint.every_steps=2"]
    sp2 = ["distributed.sequence_parallel=2"]

    def run(name: str, steps: int, *extra: str, nproc: int = 2) -> None:
        env = {"LLMFT_SAMPLE_LOG": str(tmp_path / "samples" / name)}
        args = ["train", str(recipe), *keys, f"train.max_steps={steps}", f"run.output_dir={tmp_path / name}", *extra]
        done = torchrun(args, nproc=nproc, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]

    run("ref", 4, *sp2)
    for name in ("exact", "elastic"):
        run(name, 2, *sp2)
    run("exact", 4, *sp2)
    run("elastic", 4, "distributed.sequence_parallel=1", nproc=1)

    ref_samples = {step: set(c) for step, c in sample_log(tmp_path / "samples/ref").items()}
    ref_rows, ref_w = metrics(tmp_path / "ref"), _state(tmp_path / "ref")
    for name in ("exact", "elastic"):
        samples = {step: set(c) for step, c in sample_log(tmp_path / "samples" / name).items()}
        assert samples == ref_samples, name  # steps 1-2 from the first part, 3-4 from the resume
        rows = metrics(tmp_path / name)
        assert [r["samples"] for r in rows] == [r["samples"] for r in ref_rows] == [4, 8, 12, 16]
        assert all(abs(r["loss"] - q["loss"]) <= 1e-5 * q["loss"] for r, q in zip(rows, ref_rows, strict=True))
        w = _state(tmp_path / name)
        assert max(float((w[k] - ref_w[k]).abs().max()) for k in w) <= 1e-5, name


@pytest.mark.parametrize("engine", _cases(["fsdp", "zero3"], {"zero3"}))
def test_chunked_loss_on_slices_matches_one_process(tmp_path, engine):
    """model.chunked_loss on each rank's slice (targets already shifted), in chunks of 16 tokens
    (tests/distributed/chunked_probe.py): the same first step as one plain process."""
    import os
    import subprocess

    from helpers import ROOT, torchrun_cmd

    recipe = write_recipe(
        tmp_path, model__attn_implementation="sdpa", batch__global_batch_size=4, batch__micro_batch_size=4
    )
    sgd = [*SGD[:3], "train.max_steps=1"]
    one, sp = tmp_path / "one", tmp_path / "sp"
    assert train_inproc(recipe, *sgd, "distributed.engine=single", f"run.output_dir={one}") == 0
    overrides = [*sgd, *(FSDP if engine == "fsdp" else ZERO3), *SP2, "model.chunked_loss=true", f"run.output_dir={sp}"]
    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed/chunked_probe.py"), str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    w0, w_one, w_sp = _initial(recipe, []), _state(one), _state(sp)
    step = {k: w0[k] - w_one[k] for k in w0}
    assert _norm(step) > 0 and _norm({k: w_sp[k] - w_one[k] for k in w0}) / _norm(step) <= 1e-5
    assert abs(metrics(sp)[0]["loss"] - metrics(one)[0]["loss"]) <= 1e-5 * metrics(one)[0]["loss"]
