"""``llmft train`` with ``train.objective: grpo`` in one process (file rollouts): any split of the
global batch gives the big batch's weights, with ``rl.iterations`` 1 and 2, LoRA and full; metrics,
resume, eval, compile and bad input."""

from __future__ import annotations

import json

import pytest
from grpo_runs import grpo_recipe
from helpers import max_rel_diff, metrics, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state


def _weights(tmp):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


def _train(tmp, *overrides, **sections):
    assert train_inproc(grpo_recipe(tmp, **sections), *overrides) == 0
    return _weights(tmp)


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_any_split_is_the_big_batch(tmp_path, iterations, peft):
    over = [f"rl.iterations={iterations}", f"peft.method={peft}", "rl.beta=0.05"]
    big = _train(tmp_path / "big", *over)
    split = _train(tmp_path / "split", *over, "batch.micro_batch_size=2")  # 2 x 4 accumulation steps
    assert max_rel_diff(split, big) <= 1e-5
    rows = metrics(tmp_path / "split" / "run")
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    for key in ("reward", "reward_std", "rewards/per_char", "rewards/length", "kl", "clip_fraction", "entropy"):
        assert key in first, key
    assert first["completions"] == 8 and first["completion_length"] > 1
    if iterations == 2:  # the second step reuses the first's completions: the policy moved, so ratios != 1
        assert rows[1]["generation_s"] == 0.0 and rows[1]["reward"] == first["reward"]


def test_the_three_normalisers_train_differently(tmp_path):
    weights = {n: _train(tmp_path / n, f"rl.normalise={n}") for n in ("global_token", "sequence", "constant")}
    assert max_rel_diff(weights["sequence"], weights["global_token"]) > 1e-3
    assert max_rel_diff(weights["constant"], weights["global_token"]) > 1e-3


def test_a_stopped_run_resumes_exactly(tmp_path):
    whole = _train(tmp_path / "whole", "train.max_steps=4", "rl.iterations=2")
    first = tmp_path / "resumed"
    _train(first, "train.max_steps=3", "rl.iterations=2", "checkpoint.every_steps=1")
    resumed = _train(first, "train.max_steps=4", "rl.iterations=2")  # resumes inside a generation batch
    assert max_rel_diff(resumed, whole) <= 1e-6


def test_eval_reports_the_held_out_reward(tmp_path):
    _train(tmp_path, "data.eval_fraction=0.25", "train.eval_every_steps=1")
    rows = metrics(tmp_path / "run", split="eval")
    assert rows and all("reward" in r and "rewards/per_char" in r for r in rows)
    assert rows[-1]["prompts"] == 3


def test_a_reward_function_that_raises_names_itself_and_the_record(tmp_path, capsys):
    from llmft.errors import UserError

    with pytest.raises(UserError) as e:
        train_inproc(grpo_recipe(tmp_path, rewards=[{"function": "grpo_rewards:raises"}]))
    text = str(e.value)
    assert text.startswith("rewards[0].function: raises (")
    assert "raised ValueError: boom for the record with prompt 'reverse " in text
    assert "no optimizer step was taken" in text


def test_nan_and_unknown_functions_and_a_g_that_does_not_fit(tmp_path):
    from llmft.errors import UserError
    from llmft.recipe.load import RecipeError

    with pytest.raises(UserError, match=r"rewards\[0\]\.function: nan \(.*\) returned nan for the record"):
        train_inproc(grpo_recipe(tmp_path / "nan", rewards=[{"function": "grpo_rewards:nan"}]))
    with pytest.raises(RecipeError) as e:
        train_inproc(grpo_recipe(tmp_path / "unknown", rewards=[{"function": "grpo_rewards:nope"}]))
    assert (
        "rewards[0].function: module 'grpo_rewards' has no function 'nope'. Use one of its functions (exact, "
        in str(e.value)
    )
    with pytest.raises(RecipeError) as e:
        train_inproc(grpo_recipe(tmp_path / "g", rollout__num_generations=3))
    assert "rollout.num_generations: is 3, but the global batch holds 8 completions" in str(e.value)
    assert (
        "Use a batch.global_batch_size that is a multiple of 3 (24, 48, 72 fit micro 8 x 1 rank(s)), or a G dividing 8 (2, 4, 8)"
        in str(e.value)
    )


def test_compile_prints_the_completions_equation(tmp_path, capsys):
    from llmft.cli import main

    assert main(["compile", str(grpo_recipe(tmp_path)), "--out", str(tmp_path / "compiled")]) == 0
    out = capsys.readouterr().out
    assert "completions: 2 prompts per step x G 4 = 8 = micro 8 x accumulation 1 x data-parallel 1" in out


def test_the_file_rollout_must_hold_every_prompt(tmp_path):
    from llmft.errors import UserError

    recipe = grpo_recipe(tmp_path)
    rollouts = tmp_path / "rollouts.jsonl"
    lines = rollouts.read_text().splitlines()
    rollouts.write_text("\n".join(lines[1:]) + "\n")
    first = json.loads(lines[0])["prompt"]
    with pytest.raises(UserError, match=f"rollout.file: has no line for the prompt {json.dumps(first)}"):
        train_inproc(recipe)


def test_llmft_verify_checks_a_grpo_split(tmp_path, capsys):
    """``llmft verify`` prepares the step's micro-batches of every emulated rank together (each
    group's advantages need all of its completions' rewards), then compares the gradients."""
    from llmft.training.verify import verify

    recipe = grpo_recipe(tmp_path, batch__micro_batch_size=1)
    assert verify(str(recipe), ["distributed.nproc_per_node=2", "rl.beta=0.05", "peft.method=lora"]) == 0
    out = capsys.readouterr().out
    assert "split:   micro 1 x accumulation 4 x data-parallel 2 = global 8" in out and "PASS" in out


def test_streamed_prompts_train_like_cached_ones(tmp_path):
    """``data.streaming: true``: prompts read and tokenized block by block give the cached run's weights."""
    cached = _train(tmp_path / "cached")
    streamed = _train(tmp_path / "streamed", "data.streaming=true", "train.max_steps=2")
    assert max_rel_diff(streamed, cached) <= 1e-6


def test_plan_says_the_kv_cache_and_the_reference(tmp_path, capsys):
    from llmft.cli import main

    recipe = grpo_recipe(tmp_path, rollout__backend="hf", rl__beta=0.1)
    assert main(["plan", str(recipe), "peft.method=lora"]) == 0
    out = capsys.readouterr().out
    assert "completions: 2 prompts per step x G 4 = 8 = micro 8 x accumulation 1 x data-parallel 1" in out
    # 2 (k, v) x 2 layers x 2 kv heads x 16 head dim x 64 tokens x 8 completions x 4 bytes
    assert f"generation (hf): KV cache up to {2 * 2 * 2 * 16 * 64 * 8 * 4 / 2**30:.2f} GiB per rank" in out
    assert "reference: the policy with its adapters disabled; rl.normalise global_token, rl.iterations 1" in out


def test_the_export_card_names_the_rl_settings(tmp_path):
    from llmft.cli import main

    _train(tmp_path, "rl.beta=0.05", "rl.epsilon_high=0.28")
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "grpo (online RL: G sampled completions per prompt" in card
    assert "G 4, max_new_tokens 16, temperature 1.0, beta 0.05, epsilon 0.2/0.28, normalise global_token" in card
    assert "rewards: grpo_rewards:per_char x 1.0, grpo_rewards:length x 0.5" in card


def test_sampled_rollouts_resume_with_the_same_samples(tmp_path):
    """``rollout.backend: hf``: sampling is seeded by (run.seed, generation batch, rank) in a forked
    RNG, so a run stopped after step 1 samples step 2's completions again as the whole run did."""
    hf = ["rollout.backend=hf", "rollout.max_new_tokens=8", "train.max_steps=2"]
    whole = _train(tmp_path / "whole", *hf)
    resumed = tmp_path / "resumed"
    _train(resumed, *hf[:-1], "train.max_steps=1", "checkpoint.every_steps=1")
    again = _train(resumed, *hf)
    assert max_rel_diff(again, whole) <= 1e-6
    a, b = metrics(tmp_path / "whole" / "run")[-1], metrics(resumed / "run")[-1]
    assert a["reward"] == b["reward"] and a["completion_length"] == b["completion_length"]


def test_sft_records_train_as_prompts_with_their_completion_as_a_field(tmp_path):
    """An SFT file's prompt/completion records, with ``fields: {answer: completion}``: the completion
    column reaches the reward functions as ``answer`` (a record field of any name may be mapped)."""
    prompts = tmp_path / "prompts.jsonl"
    recipe = grpo_recipe(tmp_path)
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["answer"]}) + "\n" for r in records))
    source = [{"path": str(sft), "fields": {"answer": "completion"}}]
    assert train_inproc(recipe, f"data.train={json.dumps(source)}") == 0
    assert max_rel_diff(_weights(tmp_path), _train(tmp_path / "plain")) <= 1e-6
    from llmft.data.sources import parse_sources
    from llmft.errors import UserError

    other = [{"path": str(sft), "fields": {"nope": "completion"}}]
    with pytest.raises(UserError, match=r"data.train\[0\]\.fields\.nope: is not a record field"):
        parse_sources(other, "data.train", weights=True)  # SFT and pairs: the record kinds' own names only
    assert parse_sources(other, "data.train", weights=True, open_fields=True)[0].fields == {"nope": "completion"}
