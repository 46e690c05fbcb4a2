"""GRPO on every engine: ``llmft train`` on 2 processes (gloo, torchrun) against one process, two SGD
steps on the same prompts and file rollouts: the weights agree to <= 1e-5 relative (fp32). Groups of
G=4 completions lie across ranks (micro 1 or 2 x 2 ranks), so each step's advantages need every
rank's rewards. Every engine (DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3) runs LoRA with
``rl.iterations: 2`` (the second step reuses the first's completions and old log-probs: the clipped
ratio is live) and a full fine-tune with ``rl.iterations: 1``, both with the KL to the reference
(adapters disabled; a frozen copy built like the policy). With ``rollout.backend: hf`` on the
sharding engines, ranks whose completions end at different lengths still finish (``synced_gpus``).

docs/design.md G1 (accumulation is the big batch, on every engine); docs/rl.md.
"""

from __future__ import annotations

import pytest
from grpo_runs import REWARDS, grpo_recipe, reward_model_dir, rewards_importable
from helpers import TWO_RANK_ENGINES, engine_cases, max_rel_diff, metrics, torchrun, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state

pytestmark = pytest.mark.distributed

VARIANTS = {
    "lora-it2": ["peft.method=lora", "peft.r=4", "rl.iterations=2", "rl.beta=0.05"],
    "full-it1": ["peft.method=none", "rl.iterations=1", "rl.beta=0.05"],
}
ENGINES = TWO_RANK_ENGINES
CASES = engine_cases(VARIANTS)


def _weights(tmp):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            tmp = tmp_path_factory.mktemp(f"one-{variant}")
            assert train_inproc(grpo_recipe(tmp), *VARIANTS[variant]) == 0
            cache[variant] = _weights(tmp)
        return cache[variant]

    return get


@pytest.mark.parametrize(("variant", "engine"), CASES)
def test_two_ranks_equal_one_process(tmp_path, one_process, variant, engine):
    recipe = grpo_recipe(tmp_path)
    proc = torchrun(["train", str(recipe), *VARIANTS[variant], *ENGINES[engine]], env=rewards_importable(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert max_rel_diff(_weights(tmp_path), one_process(variant)) <= 1e-5
    rows = metrics(tmp_path / "run")
    assert [r["completions"] for r in rows] == [8, 8]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_sampled_generation_on_sharded_engines_finishes(tmp_path, engine):
    """hf generate on parameters sharded over 2 ranks, sampling completions that end at different
    lengths on each rank; a held-out eval generates greedily the same way."""
    recipe = grpo_recipe(tmp_path, rollout__backend="hf", rollout__max_new_tokens=12, data__eval_fraction=0.25)
    over = [*ENGINES[engine], "train.eval_every_steps=1", "peft.method=lora", "peft.r=4"]
    proc = torchrun(["train", str(recipe), *over], env=rewards_importable(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2 and all(r["generation_s"] > 0 and 1 <= r["completion_length"] <= 12 for r in rows)
    assert metrics(tmp_path / "run", split="eval")[-1]["prompts"] == 3


@pytest.mark.slow
def test_two_ranks_resume_on_one_inside_a_generation_batch(tmp_path, one_process):
    """A 2-rank DDP run checkpointed inside a generation batch (rl.iterations 2: step 3 generates, step
    4 reuses) resumes on one process (each rank's kept completions and old log-probs, read from every
    rank's file) and ends where one process running all 4 steps does."""
    over = ["peft.method=lora", "peft.r=4", "rl.iterations=2", "rl.beta=0.05"]
    whole = tmp_path / "whole"
    assert train_inproc(grpo_recipe(whole), *over, "train.max_steps=4") == 0
    run = tmp_path / "elastic"
    recipe = grpo_recipe(run)
    first = [*over, *ENGINES["ddp"], "train.max_steps=3", "checkpoint.every_steps=1"]
    proc = torchrun(["train", str(recipe), *first], env=rewards_importable(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (run / "run/checkpoints/step-3/objective").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    assert train_inproc(recipe, *over, "train.max_steps=4", "batch.micro_batch_size=4") == 0
    assert max_rel_diff(_weights(run), _weights(whole)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_a_reward_model_sharded_like_the_policy_scores_as_one_process(tmp_path, engine):
    """A reward model goes through the engine's frozen-model door (``Engine.place_frozen``): sharded
    like the policy under FSDP2 / ZeRO-3, it gives one process's scores and weights."""
    rm = reward_model_dir(tmp_path / "rm")
    rewards = [*REWARDS, {"model": str(rm), "weight": 2.0}]
    over = ["peft.method=lora", "peft.r=4", "rl.beta=0.05"]
    one = tmp_path / "one"
    one.mkdir()
    assert train_inproc(grpo_recipe(one, rewards=rewards), *over) == 0
    two = tmp_path / "two"
    two.mkdir()
    recipe = grpo_recipe(two, rewards=rewards)
    proc = torchrun(["train", str(recipe), *over, *ENGINES[engine]], env=rewards_importable(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    column = f"rewards/{rm.name}"
    expected = [r[column] for r in metrics(one / "run") if column in r]
    got = [r[column] for r in metrics(two / "run") if column in r]
    assert expected and got == pytest.approx(expected, rel=1e-5)
    assert max_rel_diff(_weights(two), _weights(one)) <= 1e-5
