"""``rollout.file`` lines of multi-turn episodes (``llmft.objectives.episodes``): the policy tokens are
the assistant turns as the chat template's ``{% generation %}`` blocks mark them (transformers'
``return_assistant_tokens_mask``, computed independently here); tool messages and the headers
between turns are context, out of the loss and the global token count; any split and a resume
inside a generation batch land on the same weights; bad lines are named at file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from episode_runs import LIMIT, episode_recipe
from grpo_runs import G
from helpers import max_rel_diff, metrics, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state


def assistant_mask(tok, prompt: list, completion) -> tuple[list[int], list[bool]]:
    """A completion's ids and which are the policy's, computed independently: the whole conversation
    through transformers' ``return_assistant_tokens_mask`` (the template's ``{% generation %}``
    blocks), after the prompt rendered with its generation prompt; cut at ``LIMIT`` tokens."""
    head = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    if isinstance(completion, str):
        ids = tok(completion, add_special_tokens=False)["input_ids"][:LIMIT]
        ids += [tok.eos_token_id] if len(ids) < LIMIT else []
        return ids, [True] * len(ids)
    out = tok.apply_chat_template(
        prompt + completion, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[: len(head)] == head
    return ids[len(head) :][:LIMIT], [bool(m) for m in mask[len(head) :][:LIMIT]]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_policy_tokens_are_the_assistant_turns(tmp_path):
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.objectives.episodes import Episode
    from llmft.objectives.rollout import FileRollout, Prompt
    from llmft.recipe.load import load_recipe

    tok = byte_tokenizer()
    recipe = load_recipe(str(episode_recipe(tmp_path)), [])
    rollout = FileRollout(recipe, tok)
    lines = _lines(tmp_path / "episodes.jsonl")
    prompts = [Prompt(torch.tensor([0]), {"prompt": line["prompt"]}, q) for line in lines for q in range(G)]
    got = rollout.complete(prompts, 0, 0)
    cut = tool = 0
    for ids, (line, j) in zip(got, [(line, j) for line in lines for j in range(G)], strict=True):
        want_ids, want_mask = assistant_mask(tok, line["prompt"], line["completions"][j])
        assert list(ids) == want_ids
        if isinstance(ids, Episode):
            assert ids.policy == want_mask
            assert ids.text == ([m for m in line["completions"][j] if m["role"] == "assistant"][-1]["content"] or "")
            cut += len(ids) == LIMIT
            tool += not all(ids.policy)
        else:
            assert isinstance(line["completions"][j], str)
    assert cut and tool  # the file has episodes that are cut and episodes with context tokens


def _weights(tmp: Path):
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


def test_any_split_is_the_big_batch_and_counts_the_policy_tokens(tmp_path, episode_rewards):
    from llmft.data.tokenizer import byte_tokenizer

    over = ["rl.iterations=2", "rl.beta=0.05"]
    assert train_inproc(episode_recipe(tmp_path / "big"), *over) == 0
    assert train_inproc(episode_recipe(tmp_path / "split", batch__micro_batch_size=2), *over) == 0
    assert max_rel_diff(_weights(tmp_path / "split"), _weights(tmp_path / "big")) <= 1e-5
    tok = byte_tokenizer()
    lines = _lines(tmp_path / "big" / "episodes.jsonl")
    policy = sum(sum(assistant_mask(tok, line["prompt"], c)[1]) for line in lines[:2] for c in line["completions"])
    every = sum(len(assistant_mask(tok, line["prompt"], c)[0]) for line in lines[:2] for c in line["completions"])
    assert policy < every  # the context tokens are in the sequences, not in the count
    for run in ("big", "split"):
        rows = metrics(tmp_path / run / "run")
        assert [r["step"] for r in rows] == [1, 2]
        first = rows[0]
        assert first["tokens"] == policy and first["completion_tokens"] == policy
        turns = [sum(m["role"] == "assistant" for m in c) for line in lines[:2] for c in line["completions"][:3]]
        assert first["turns"] == pytest.approx(sum(turns) / len(turns))
        assert first["tool_calls"] > 0 and first["completions"] == 8


def test_a_resume_inside_a_generation_batch_is_exact(tmp_path, episode_rewards):
    over = ["rl.iterations=2", "rl.beta=0.05"]
    assert train_inproc(episode_recipe(tmp_path / "whole"), *over, "train.max_steps=4") == 0
    first = tmp_path / "resumed"
    assert train_inproc(episode_recipe(first), *over, "train.max_steps=3", "checkpoint.every_steps=1") == 0
    state = torch.load(first / "run" / "checkpoints" / "step-3" / "objective" / "rank-0.pt", weights_only=True)
    masks = state["policy_masks"]
    assert len(masks) == 8 and not all(bool(m.all()) for m in masks)
    assert [int(m.sum()) for m in masks] == [o.numel() for o in state["old_logps"]]
    assert train_inproc(episode_recipe(first), *over, "train.max_steps=4") == 0  # resumes inside generation 1
    assert max_rel_diff(_weights(first), _weights(tmp_path / "whole")) <= 1e-6


def test_a_damaged_policy_mask_is_named(tmp_path):
    from llmft.errors import UserError
    from llmft.objectives.grpo import check_state

    ids = torch.tensor([5, 6, 7])
    state = {
        "objective": "grpo",
        "format": 1,
        "positions": torch.tensor([0]),
        "completions": [ids],
        "old_logps": [torch.zeros(2)],
        "advantages": torch.zeros(1),
        "stats": {},
        "policy_masks": [torch.tensor([True, False, True])],
    }
    assert check_state(state, "f.pt") == 1
    state["policy_masks"] = [torch.tensor([True, True, True])]
    with pytest.raises(UserError) as e:
        check_state(state, "f.pt")
    assert "f.pt: is damaged: the old log-probs of completion 0 are not 3 numbers, one per policy token" in str(e.value)
    state["policy_masks"] = [torch.tensor([1, 0, 1])]
    with pytest.raises(UserError) as e:
        check_state(state, "f.pt")
    assert "the policy mask of completion 0 is not 3 booleans, one per token" in str(e.value)


def test_bad_episode_lines_are_named_at_their_line(tmp_path):
    from llmft.errors import UserError
    from llmft.objectives.rollout import read_rollout_file

    good = [{"role": "assistant", "content": "5"}]
    bad = tmp_path / "bad.jsonl"
    lines = [
        {"prompt": "add 2 3", "completions": [good] * G},
        {"prompt": [{"role": "user", "content": "a"}], "completions": [[{"role": "tool", "content": "5"}]] * G},
        {"prompt": [{"role": "user", "content": "b"}], "completions": [[{"role": "system", "content": "x"}]] * G},
        {"prompt": [{"role": "user", "content": "c"}], "completions": [[]] * G},
        {"prompt": [{"role": "user", "content": "d"}], "completions": [good] * (G - 1) + [7]},
    ]
    bad.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UserError) as e:
        read_rollout_file(str(bad), G)
    text = str(e.value)
    assert f"{bad}:1: completion 0 is an episode (a list of messages), but the prompt is not messages" in text
    assert (
        f"{bad}:2: completion 0 is not an episode: starts with a 'tool' message, not the policy's (assistant)" in text
    )
    assert f"{bad}:3: completion 0 is not an episode: messages[0].role 'system' is not one of" in text
    assert f"{bad}:4: completion 0 is not an episode: 'messages' must be a non-empty list" in text
    assert f"{bad}:5: has {G} completions, not {G} strings or episodes" in text


def test_a_template_that_does_not_render_prefixes_is_named_at_the_line(tmp_path, episode_rewards):
    from llmft.errors import UserError

    template = tmp_path / "last-differs.jinja"  # the last message rendered otherwise than earlier ones
    template.write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{% if loop.last %}!{% endif %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    with pytest.raises(UserError) as e:
        train_inproc(episode_recipe(tmp_path / "run-dir", data__chat_template=str(template)))
    text = str(e.value)
    assert (
        f"{tmp_path / 'run-dir' / 'episodes.jsonl'}:1: a multi-turn episode cannot be tokenized: the chat template "
        in text
    )
    assert "does not render the conversation up to message 0 of the episode as a prefix" in text


def test_llmft_verify_checks_a_split_of_episodes(tmp_path, episode_rewards, capsys):
    """``llmft verify`` on a recipe of file episodes: 2 emulated ranks x micro 2 against the big
    batch, the context tokens out of both."""
    from llmft.training.verify import verify

    recipe = episode_recipe(tmp_path, batch__micro_batch_size=2)
    assert verify(str(recipe), ["distributed.nproc_per_node=2", "rl.beta=0.05"]) == 0
    assert "PASS: largest relative difference" in capsys.readouterr().out
