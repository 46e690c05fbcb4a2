"""A GRPO reward model (``rewards: [{model: DIR}]``) must have a trained score head.

A directory that would load with a freshly initialised head (a causal LM's dir, weights without
``score.weight``, a classifier of several labels) would make GRPO train on the scores of random
weights. It is refused, naming the directory and what is missing, and how to get a reward model:
by ``llmft train`` / ``compile`` / ``plan`` when the recipe is checked (its config.json and safetensors
headers are read: before the policy is built, nothing allocated), and by ``load_reward_model``
itself, which also refuses any weight transformers reports it had to initialise (a hub model, a
.bin checkpoint). A real reward model (one label, its head saved) is accepted
(tests/unit/test_grpo_objective.py scores with one).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from grpo_runs import grpo_recipe
from helpers import TINY_LLAMA, save_tiny_pretrained
from safetensors.torch import load_file, save_file

from llmft.cli import main
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.objectives.rewards import Rewards

FIX = (
    "A reward model is a sequence classifier with one label and a trained score head: train one with "
    "train.objective: reward and export it (llmft export writes an AutoModelForSequenceClassification directory), "
    "then name that directory here."
)


def _reward_model(out: Path, num_labels: int = 1) -> Path:
    """A sequence classifier saved as ``train.objective: reward``'s export is (head saved, one label)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(3)
    tok = byte_tokenizer()
    config = AutoConfig.for_model(**{**TINY_LLAMA, "num_labels": num_labels, "pad_token_id": tok.pad_token_id})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _causal_lm(out: Path) -> Path:
    return save_tiny_pretrained(out, seed=1)


def _without_head(out: Path) -> Path:
    """A reward model dir whose weights lost ``score.weight`` (its config still says a classifier)."""
    d = _reward_model(out)
    weights = load_file(d / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _refusal(rm: Path) -> str:
    with pytest.raises(UserError) as e:
        Rewards([{"model": str(rm)}], torch.device("cpu"), byte_tokenizer())
    return str(e.value)


RECIPE = "the recipe has 1 problem(s):\n  - "  # how the recipe checks list what they found


def _train_refusal(tmp_path: Path, rm: Path, command: str = "train") -> tuple[int, str, bool]:
    """``llmft COMMAND`` of a GRPO recipe scoring with ``rm``: exit code, stderr, and whether the
    policy was built (train stops where it would start the process group)."""
    recipe = grpo_recipe(tmp_path / "run", rewards=[{"model": str(rm)}])
    err, built = io.StringIO(), []

    class Reached(Exception):
        pass

    def reached(*a, **k):
        built.append(True)
        raise Reached

    argv = [command, str(recipe)] + (["--out", str(tmp_path / "out")] if command == "compile" else [])
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        mock.patch("llmft.training.train.init_distributed", side_effect=reached),
    ):
        try:
            code = main(argv)
        except Reached:
            code = 0
    return code, err.getvalue(), bool(built)


def test_a_causal_lm_dir_is_refused_before_the_policy_is_built(tmp_path):
    rm = _causal_lm(tmp_path / "clm")
    what = (
        f"rewards[0].model: {rm / 'config.json'}: architectures is ['LlamaForCausalLM'], not a sequence "
        "classifier: its weights hold no trained score head, and GRPO would train on the scores of a freshly "
        f"initialised one. {FIX}"
    )
    for command in ("train", "compile", "plan"):
        code, err, built = _train_refusal(tmp_path, rm, command)
        assert (code, err.strip(), built) == (2, f"llmft {command}: error: {RECIPE}{what}", False), err[-2000:]
    assert _refusal(rm) == what  # and by the loader itself


def test_weights_without_the_score_head_are_refused(tmp_path):
    rm = _without_head(tmp_path / "rm")
    what = (
        f"rewards[0].model: the weights of '{rm}' hold no score head (no score.weight): transformers would "
        f"initialise it fresh, and GRPO would train on the scores of that random head. {FIX}"
    )
    assert _refusal(rm) == what
    code, err, built = _train_refusal(tmp_path, rm)
    assert (code, err.strip(), built) == (2, f"llmft train: error: {RECIPE}{what}", False)


def test_a_classifier_of_several_labels_is_refused(tmp_path):
    rm = _reward_model(tmp_path / "rm3", num_labels=3)
    assert _refusal(rm) == (
        f"rewards[0].model: {rm / 'config.json'}: id2label has 3 labels; a reward model scores with one. {FIX}"
    )
    rm = _reward_model(tmp_path / "rm2", num_labels=2)  # transformers' default of 2 labels: no id2label written
    assert _refusal(rm) == (
        f"rewards[0].model: score.weight in '{rm}' has shape [2, 64]: a classifier of 2 labels; a reward model "
        f"scores with one. {FIX}"
    )


def test_what_transformers_initialised_fresh_is_refused_when_it_loads(tmp_path, monkeypatch):
    """Where the directory cannot be read first (a hub id, a .bin checkpoint), the loading info judges:
    a weight transformers reports missing, and so initialised, refuses the model."""
    rm = _causal_lm(tmp_path / "clm")
    monkeypatch.setattr("llmft.objectives.rewards.reward_model_problems", lambda path, key: [])
    assert _refusal(rm) == (
        f"rewards[0].model: the weights of reward model '{rm}' hold no score.weight: transformers initialised it "
        f"fresh, and GRPO would train on the scores of those random weights. {FIX}"
    )


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        ("no-config", "'{rm}' has no config.json, so it is not a Hugging Face model directory. " + FIX),
        (
            "not-json",
            "{rm}/config.json is not valid JSON. Copy or save the reward model again (save_pretrained).",
        ),
        (
            "huge",
            "{rm}/config.json: hidden_size is 1000000000000, above the 16,777,216 llmft accepts for a size (a "
            "typo?). Set it to a whole number in [1, 16,777,216] (published models' values are far below the top).",
        ),
        (
            "defaults",  # found by the fuzzing harness: a 7B model's defaults for a 460 KB model
            "{rm}/config.json: describes at least 3.6e+09 parameters, but the weight files beside it hold {size:,} "
            "bytes (more than 16 parameters a byte): a size has a typo, or the config is another model's. Use the "
            "config.json saved with these weights (save_pretrained writes both), or correct the size.",
        ),
        (
            "list",
            "{rm}/config.json: is a JSON list, not an object of config fields. Write it again with save_pretrained, "
            "or copy the model's published config.json.",
        ),
        ("file", "'{rm}' is a file, not a model directory. " + FIX),
        (
            "bad-header",
            "{rm}/model.safetensors: is damaged (its header length 18446744073709551615 does not fit the file's "
            "{size} bytes). Copy or save the reward model again (save_pretrained).",
        ),
    ],
)
def test_a_damaged_reward_model_dir_is_named(tmp_path, damage, what):
    rm = _reward_model(tmp_path / "rm")
    config, size = rm / "config.json", 0
    if damage == "no-config":
        config.unlink()
    elif damage == "not-json":
        config.write_text('{"model_type": "llama", ')
    elif damage == "huge":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 10**12}))
    elif damage == "defaults":
        config.write_text('{"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}')
        size = (rm / "model.safetensors").stat().st_size
    elif damage == "list":
        config.write_text("[]")
    elif damage == "file":
        rm = tmp_path / "rm.json"
        rm.write_text("{}")
    elif damage == "bad-header":
        weights = rm / "model.safetensors"
        weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
        size = weights.stat().st_size
    message = f"rewards[0].model: {what.format(rm=rm, size=size)}"
    assert _refusal(rm) == message
    if damage == "defaults":  # the family's defaults are transformers' to fill in: judged when it loads
        return
    code, err, built = _train_refusal(tmp_path, rm)
    assert (code, err.strip(), built) == (2, f"llmft train: error: {RECIPE}{message}", False)


def test_a_reward_model_is_accepted(tmp_path):
    rm = _reward_model(tmp_path / "rm")
    rewards = Rewards([{"model": str(rm)}], torch.device("cpu"), byte_tokenizer())
    assert rewards.names == ("rm",)
    code, err, built = _train_refusal(tmp_path, rm)
    assert (code, built) == (0, True), err[-2000:]
