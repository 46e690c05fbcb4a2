"""What the multi-turn episode tests share: a rollout file of episodes (tool calls, tool results,
answers) for chat prompts of additions, the reward module that scores them, and their recipe."""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpo_runs import G, grpo_recipe

LIMIT = 96  # rollout.max_new_tokens: some episodes below are longer, and are cut


REWARD_MODULE = '''
def episode(prompt, completion, answer, completion_messages=None, **_):
    """The last assistant message's text against the answer, and the turns taken (so that the
    completions of a group differ); checks what it is given."""
    assert isinstance(prompt, list), prompt
    if completion_messages is None:  # a plain completion of the same line
        return float(completion.strip() == answer)
    last = [m for m in completion_messages if m["role"] == "assistant"][-1]
    assert completion == (last["content"] or ""), (completion, last)
    return float(completion.strip() == answer) + 0.1 * len(completion_messages)
'''


def _call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}


def _episodes(rng: random.Random, a: int, b: int) -> list:
    """G completions of one prompt: a tool call and its answer, a direct answer, two tool calls, a
    plain string (a line may mix them), and one that ends on a tool result."""
    s = str(a + b)
    one = [
        {"role": "assistant", "content": "", "tool_calls": [_call(a, b)]},
        {"role": "tool", "content": s},
        {"role": "assistant", "content": s},
    ]
    direct = [{"role": "assistant", "content": str(a + b + rng.randint(0, 3))}]
    two = [
        {"role": "assistant", "content": "let me add", "tool_calls": [_call(a, 0), _call(0, b)]},
        {"role": "tool", "content": str(a)},
        {"role": "tool", "content": str(b)},
        {"role": "assistant", "content": "", "tool_calls": [_call(a, b)]},
        {"role": "tool", "content": s},
        {"role": "assistant", "content": s},
    ]
    open_end = [{"role": "assistant", "content": "", "tool_calls": [_call(b, a)]}, {"role": "tool", "content": s}]
    return [one, direct, rng.choice([two, open_end]), s + "!"][:G]


def write_episodes(tmp: Path, n: int = 8, seed: int = 5) -> tuple[Path, Path]:
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    prompts, rollouts = tmp / "chat-prompts.jsonl", tmp / "episodes.jsonl"
    with open(prompts, "w") as p, open(rollouts, "w") as r:
        for _ in range(n):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            prompt = [{"role": "user", "content": f"add {a} {b}"}]
            p.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
            r.write(json.dumps({"prompt": prompt, "completions": _episodes(rng, a, b)}) + "\n")
    return prompts, rollouts


def episode_recipe(tmp: Path, **sections) -> Path:
    prompts, rollouts = write_episodes(tmp)
    base = {
        "data__train": str(prompts),
        "data__max_seq_len": 160,
        "rollout__file": str(rollouts),
        "rollout__max_new_tokens": LIMIT,
        "rewards": [{"function": "episode_rewards:episode", "weight": 1.0}],
        "rl__reward_workers": 0,
    }
    return grpo_recipe(tmp, **{**base, **sections})
