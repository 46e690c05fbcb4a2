"""llmft GRPO against an outside implementation, weight for weight: TRL's ``GRPOTrainer`` (the version
the dev extra pins; tests/trl_grpo_peer.py injects the completions into its generation) and
``llmft train`` with ``rollout.backend: file`` on the same model dir, the same prompts in the same
order, the same completions and the same reward, two SGD steps of a full fine-tune (fp32).

TRL's ``dapo`` loss is llmft's ``rl.normalise: global_token`` (every completion token of the global
batch): the two land on the same weights for any llmft split of the 8 completions of a step (micro
8, and micro 2 x 4 accumulation steps). TRL's ``grpo`` loss (per-completion token means) is a control
that must land elsewhere. Tokens: llmft's prompt is ``tokenizer(prompt)`` (bos + bytes) and its
file completion the text's bytes + eos, as the harness injects them into TRL (checked there)."""

from __future__ import annotations

import json

import pytest
from grpo_rewards import reversal
from helpers import save_tiny_pretrained, train_inproc, write_recipe
from trl_grpo_peer import trl_grpo_run, weight_diffs

from llmft.export.consolidate import load_checkpoint_model, trainable_state

G, LR, STEPS = 4, 0.5, 2
WORDS = ["abc", "hello", "xy", "qrstuvw"]
PROMPTS = [f"reverse {w}:" for w in WORDS]
COMPLETIONS = {f"reverse {w}:": [w[::-1], w, f"{w}?!{w}", w[::-1][: max(1, len(w) // 2)]] for w in WORDS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("grpo-trl") / "model", seed=1)


@pytest.fixture(scope="module")
def trl(model_dir):
    runs = {}

    def get(loss_type: str):
        if loss_type not in runs:
            runs[loss_type] = trl_grpo_run(
                model_dir,
                PROMPTS,
                COMPLETIONS,
                lambda prompt, completion: reversal(prompt, completion),
                num_generations=G,
                per_device_batch=4,
                grad_accum=2,
                steps=STEPS,
                lr=LR,
                loss_type=loss_type,
                max_completion_length=16,
            )
        return runs[loss_type]

    return get


def _llmft(tmp, model_dir, micro: int) -> dict:
    prompts, rollouts = tmp / "prompts.jsonl", tmp / "rollouts.jsonl"
    tmp.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rollouts.write_text("".join(json.dumps({"prompt": p, "completions": COMPLETIONS[p]}) + "\n" for p in PROMPTS))
    recipe = write_recipe(
        tmp,
        model__name_or_path=str(model_dir),
        model__config=None,
        data__train=str(prompts),
        data__shuffle=False,
        train__objective="grpo",
        train__max_steps=STEPS,
        rollout__num_generations=G,
        rollout__max_new_tokens=16,
        rollout__backend="file",
        rollout__file=str(rollouts),
        rewards=[{"function": "grpo_rewards:reversal"}],
        batch__global_batch_size=8,
        batch__micro_batch_size=micro,
        optim__name="sgd",
        optim__lr=LR,
        optim__max_grad_norm=None,
    )
    assert train_inproc(recipe) == 0
    return trainable_state(load_checkpoint_model(tmp / "run")[0])


@pytest.mark.parametrize("micro", [8, 2])
def test_global_token_lands_on_trl_dapo_and_not_on_trl_grpo(tmp_path, model_dir, trl, micro):
    ours = _llmft(tmp_path, model_dir, micro)
    dapo = trl("dapo")
    d = weight_diffs(ours, dapo.final, dapo.initial)
    assert d["update"] <= 1e-4 and d["weights"] <= 1e-4, d
    control = trl("grpo")
    assert weight_diffs(ours, control.final, control.initial)["update"] > 1e-2  # per-sequence means differ
