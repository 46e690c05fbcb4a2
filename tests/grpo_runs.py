"""What the GRPO run tests share: prompts of the reversal task, a rollout file of G completions per
prompt, and a recipe over a tiny pretrained model dir (``train.objective: grpo``)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from helpers import ROOT, save_tiny_pretrained, write_recipe

G = 4
TESTS = ROOT / "tests"
REWARDS = [{"function": "grpo_rewards:per_char", "weight": 1.0}, {"function": "grpo_rewards:length", "weight": 0.5}]


def write_prompts(tmp: Path, n: int = 12, seed: int = 3) -> tuple[Path, Path]:
    """``n`` prompts (``reverse <word>:`` with its ``answer``) and a rollout file giving each G
    completions of different lengths and quality."""
    rng = random.Random(seed)
    prompts, rollouts = tmp / "prompts.jsonl", tmp / "rollouts.jsonl"
    tmp.mkdir(parents=True, exist_ok=True)
    with open(prompts, "w") as p, open(rollouts, "w") as r:
        for _ in range(n):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 9)))
            prompt, answer = f"reverse {word}:", word[::-1]
            completions = [answer, answer[: rng.randint(0, len(answer))], word, answer + "x" * rng.randint(1, 5)]
            p.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
            r.write(json.dumps({"prompt": prompt, "completions": completions}) + "\n")
    return prompts, rollouts


def grpo_recipe(tmp: Path, **sections) -> Path:
    """A GRPO recipe: file rollouts, plain SGD (exact comparisons), fp32, a model dir shared per ``tmp``."""
    model = tmp.parent / "grpo-model"
    if not model.exists():
        save_tiny_pretrained(model, seed=1)
    prompts, rollouts = write_prompts(tmp)
    base = {
        "model__name_or_path": str(model),
        "model__config": None,
        "data__train": str(prompts),
        "train__objective": "grpo",
        "rollout__num_generations": G,
        "rollout__max_new_tokens": 16,
        "rollout__backend": "file",
        "rollout__file": str(rollouts),
        "rewards": REWARDS,
        "batch__global_batch_size": 8,
        "batch__micro_batch_size": 8,
        "optim__name": "sgd",
        "optim__lr": 0.5,
        "optim__max_grad_norm": None,
        "data__shuffle": False,
    }
    return write_recipe(tmp, **{**base, **sections})


def rewards_importable() -> dict[str, str]:
    """The environment of a subprocess that imports the reward functions (tests/grpo_rewards.py)."""
    return {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def reward_model_dir(out: Path) -> Path:
    """A tiny one-label sequence classifier saved as ``train.objective: reward``'s export is (fp32)."""
    import torch
    from helpers import TINY_LLAMA
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from llmft.data.tokenizer import byte_tokenizer

    torch.manual_seed(3)
    tok = byte_tokenizer()
    config = AutoConfig.for_model(**{**TINY_LLAMA, "num_labels": 1, "pad_token_id": tok.pad_token_id})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    return out


def replay_file(run: Path, out: Path, G: int = G) -> Path:
    """The completions a run saved (``rollout.save_completions``, every rank's) as a ``rollout.file``
    of ``completion_ids`` by prompt; a live episode's with its ``policy_masks``, ``prompt_ids`` and
    ``episodes`` (the messages), so that a file run trains the same tokens."""
    by_prompt: dict[str, dict[int, dict]] = {}
    prompts: dict[str, object] = {}
    for f in sorted((run / "completions").glob("rank-*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            key = json.dumps(row["prompt"], sort_keys=True)
            prompts[key] = row["prompt"]
            by_prompt.setdefault(key, {})[row["position"] % G] = row
    with open(out, "w") as f:
        for key, rows in by_prompt.items():
            assert sorted(rows) == list(range(G))
            group = [rows[q] for q in range(G)]
            line = {"prompt": prompts[key], "completion_ids": [r["completion_ids"] for r in group]}
            if "policy_mask" in group[0]:
                line["policy_masks"] = [r["policy_mask"] for r in group]
                line["prompt_ids"] = [r["prompt_ids"] for r in group]
                line["episodes"] = [r["messages"] for r in group]
            f.write(json.dumps(line) + "\n")
    return out
