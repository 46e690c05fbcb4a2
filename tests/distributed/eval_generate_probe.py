"""Run under torchrun: train with the exact-match eval on, each rank's generation stopping at another length.

Arguments: RECIPE [KEY=VALUE ...] (overrides).

Rank r generates at most ``1 + 4 * r`` new tokens, so rank 0 is done while rank 1 still runs
forwards: where the parameters are sharded every forward all-gathers them from every rank, so the
finished rank must keep joining (``synced_gpus``) or the other waits forever. Prints, per rank,
one line ``GENERATED <rank> <json list of the texts each generate() call returned>``.
"""

from __future__ import annotations

import json
import os
import sys

from transformers.generation.utils import GenerationMixin

from llmft.dist import leave_process
from llmft.evaluate import Evaluator
from llmft.train import train

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
    print(f"GENERATED {os.environ.get('RANK', '0')} {json.dumps(TEXTS)}", flush=True)
    leave_process(code)  # without the interpreter's teardown (llmft.dist.leave_process says why)
