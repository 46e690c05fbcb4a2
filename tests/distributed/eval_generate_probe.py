"""Run under torchrun: train with the exact-match eval on, each rank's generation stopping at another length.

Arguments: RECIPE [KEY=VALUE ...] (overrides).

Rank r generates at most ``1 + 4 * r`` new tokens, so rank 0 is done while rank 1 still runs
forwards: where the parameters are sharded every forward all-gathers them from every rank, so the
finished rank must keep joining (``synced_gpus``) or the other waits forever. Each rank writes the
texts each generate() call returned, as JSON, to ``generated-<rank>.json`` beside the recipe (a
file per rank: two ranks' lines on one shared stdout can interleave).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers.generation.utils import GenerationMixin

from llmft.job.dist import leave_process
from llmft.training.evaluate import Evaluator
from llmft.training.train import train

TEXTS: list[list[str]] = []


def _uneven_lengths() -> None:
    generate = GenerationMixin.generate
    rank = int(os.environ.get("RANK", "0"))

    def shorter(self, *args, **kwargs):
        kwargs["max_new_tokens"] = 1 + 4 * rank
        return generate(self, *args, **kwargs)

    GenerationMixin.generate = shorter


def _record() -> None:
    original = Evaluator._generate

    def record(self, prompt_ids):
        texts = original(self, prompt_ids)
        TEXTS.append(texts)
        return texts

    Evaluator._generate = record


if __name__ == "__main__":
    _uneven_lengths()
    _record()
    code = train(sys.argv[1], sys.argv[2:])
    rank = os.environ.get("RANK", "0")
    (Path(sys.argv[1]).parent / f"generated-{rank}.json").write_text(json.dumps(TEXTS))
    leave_process(code)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)
