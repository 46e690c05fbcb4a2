"""Reward function of the tool-calling quickstart: the product task of data/quickstart-tools/
(scripts/make_tools_data.py).

A prompt record is ``{"prompt": [{"role": "user", "content": "347*29=?"}], "answer": "10063"}``.
llmft calls the function once per completion as ``fn(prompt=..., completion=..., answer=...)``; for
an episode (the model calls the calculator, examples/tools/calculator.py, reads its result, then
answers) ``completion`` is the text of the episode's last assistant message, so only the final
answer counts: a tool call without an answer after it scores 0. ``**_`` takes any other field
(``completion_messages``, the record's own fields).

The recipe names it ``arithmetic:correct``, so this folder must be importable: run from the
repository root with ``PYTHONPATH=examples/rewards``.
"""

from __future__ import annotations


def correct(prompt: object, completion: str, answer: str, **_: object) -> float:
    """1.0 when the final answer is the record's answer (surrounding whitespace ignored), else 0.0."""
    return float(completion.strip() == str(answer).strip())
