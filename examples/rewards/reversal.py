"""Reward functions of the GRPO quickstart (configs/quickstart-grpo.yaml): the reversal task.

A prompt record is ``{"prompt": "reverse: cabd\\n", "answer": "dbac"}`` (the SFT quickstart's record
with its completion as ``answer``: data/quickstart/prompts-*.jsonl). llmft calls each function once
per completion as ``fn(prompt=..., completion=..., answer=...)``; ``**_`` takes any other field of
the record.

The recipe names them ``reversal:exact`` and ``reversal:per_char``, so this folder must be
importable: run from the repository root with ``PYTHONPATH=examples/rewards``.
"""

from __future__ import annotations


def exact(prompt: str, completion: str, answer: str, **_: object) -> float:
    """1.0 when the completion is the answer (surrounding whitespace ignored), else 0.0."""
    return float(completion.strip() == answer)


def per_char(prompt: str, completion: str, answer: str, **_: object) -> float:
    """Partial credit: the answer's characters the completion has at their place, less one for each
    character it has beyond the answer's length (so padding a guess never pays), over the answer's
    length; from 0.0 to 1.0."""
    got = completion.strip()
    hits = sum(a == b for a, b in zip(got, answer, strict=False))
    extra = max(len(got) - len(answer), 0)
    return max(hits - extra, 0) / max(len(answer), 1)
