"""What the live multi-turn episode tests share (``rollout.tools``, ``rollout.environment``): a module
of tools and a TRL-style environment class (importable as ``agent_tools`` once written to a folder on
the path), chat prompts of additions, and a recipe generating episodes with them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpo_runs import grpo_recipe

TOOLS_MODULE = '''
import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    after = os.environ.get("LLMFT_TEST_KILL_AFTER")  # the kill -9 test: dies in the first call once it exists
    if after and os.path.exists(after):
        os.kill(os.getpid(), 9)
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken tool got {x}")


def correct(prompt, completion, answer, **_):
    return float(completion.strip() == answer)


def shaped(prompt, completion, completion_messages=None, **_):
    """Tool results seen, less a little for the answer's length: differs between the episodes of a group."""
    after = os.environ.get("LLMFT_TEST_KILL_SCORING_AFTER")  # the kill -9 test: dies scoring once it exists
    if after and os.path.exists(after):
        os.kill(os.getpid(), 9)
    tools = sum(m["role"] == "tool" for m in completion_messages or [])
    return tools - 0.01 * len(completion)


class Counter:
    """An environment in TRL's environment_factory contract: tool methods, reset, get_reward."""

    def __init__(self):
        self.total = 0
        self.calls = 0

    def reset(self, **record):
        self.total = int(record.get("start", 0))
        self.calls = 0
        return f" (the counter starts at {self.total})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.calls += 1
        self.total += by
        return self.total

    def get_reward(self):
        return float(self.calls)


def stuck(seconds: float) -> str:
    """Waits.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "late"


class Sleepy(Counter):
    def wait(self, seconds: float) -> int:
        """Waits.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return self.total


class WordReward(Counter):
    def get_reward(self):
        return "high"


class BadReset(Counter):
    def reset(self, **record):
        raise ValueError("no board for " + str(record.get("answer")))
'''


CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


def tool_model(out: Path, steps: int = 80, lr: float = 1e-2, **config) -> Path:
    """A tiny model dir (byte tokenizer, llmft template) fitted in plain torch to one transcript shape:
    any question, a call add(a=1, b=2), its result, the answer "3". Sampled at temperature 1 it calls
    the tool most of the time and sometimes writes a call that does not parse or answers at once."""
    import torch
    from helpers import save_tiny_pretrained
    from transformers import AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer

    if (out / "config.json").exists():
        return out
    save_tiny_pretrained(out, seed=2, **config)
    tok = byte_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out)
    rng = random.Random(0)
    texts = []
    for i in range(32):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [
            {"role": "user", "content": f"{a}+{b}"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "name": "add", "content": "3"},
            {"role": "assistant", "content": "3"},
        ]
        if i % 4 == 0:  # a quarter answer at once
            messages[1:] = [{"role": "assistant", "content": "7"}]
        texts.append(tok.apply_chat_template(messages, tokenize=False))
    batch = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    model.save_pretrained(out)
    return out


def write_tools(folder: Path) -> None:
    (folder / "agent_tools.py").write_text(TOOLS_MODULE)


def write_chat_prompts(tmp: Path, n: int = 8, seed: int = 7) -> Path:
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "chat-prompts.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            record = {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b), "start": a}
            f.write(json.dumps(record) + "\n")
    return path


def agent_recipe(tmp: Path, **sections) -> Path:
    base = {
        "data__train": str(write_chat_prompts(tmp)),
        "data__max_seq_len": 400,
        "data__chat_template": "llmft",
        "rollout__backend": "hf",
        "rollout__file": None,
        "rollout__max_new_tokens": 200,
        "rollout__tools": ["agent_tools:add"],
        "rollout__max_turns": 3,
        "rewards": [{"function": "agent_tools:correct", "weight": 1.0}],
        "rl__reward_workers": 0,
        "optim__lr": 0.05,  # the fitted model's calls survive a few steps
    }
    return grpo_recipe(tmp, **{**base, **sections})


def tool_recipe(tmp: Path, model: Path, **over) -> Path:
    """``agent_recipe`` on the fitted tool model (``tool_model``), rewarded by ``shaped``."""
    base = {
        "model__name_or_path": str(model),
        "rewards": [{"function": "agent_tools:shaped", "weight": 1.0}],
        "rollout__max_new_tokens": 120,
        "data__max_seq_len": 160,
    }
    return agent_recipe(tmp, **{**base, **over})
