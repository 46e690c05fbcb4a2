"""Reward functions the GRPO tests name in their recipes (``rewards: [{function: "grpo_rewards:..."}]``).

The reversal task of the quickstart: a prompt ``reverse <word>:`` whose answer is the word reversed
(the record's ``answer`` field)."""

from __future__ import annotations

import math


def exact(prompt, completion, answer, **_):
    """1 when the completion is the answer (surrounding spaces ignored), else 0."""
    return float(completion.strip() == answer)


def per_char(prompt, completion, answer, **_):
    """Partial credit: the fraction of the answer's characters the completion has at their place."""
    got = completion.strip()
    return sum(a == b for a, b in zip(got, answer, strict=False)) / max(len(answer), 1)


def length(prompt, completion, **_):
    """A reward that differs between completions of one group whatever the answer: its length / 10."""
    return len(completion) / 10


def not_mine(prompt, completion, **_):
    """None: no opinion (counts 0 in the weighted sum, left out of this column's mean)."""
    return None


def raises(prompt, completion, **_):
    raise ValueError("boom")


def nan(prompt, completion, **_):
    return math.nan


def reversal(prompt, completion, **_):
    """The TRL peer test's reward (a function of the prompt alone: TRL passes no record fields):
    1 for the reversed word, plus 0.1 a character."""
    word = prompt.removeprefix("reverse ").removesuffix(":")
    return float(completion == word[::-1]) + 0.1 * len(completion)
