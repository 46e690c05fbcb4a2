"""Whole ``llmft train`` dpo runs on a small pair file, and how to compare two of them: shared by
tests/integration/test_preference_precompute.py and tests/distributed/test_preference_precompute_ranks.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from helpers import metrics, write_recipe

from llmft.export.consolidate import load_checkpoint_model, trainable_state

TOL = 1e-6


def write_pairs(path: Path, n: int = 40, seed: int = 0) -> Path:
    """Reversal pairs of very different lengths (chosen: the reversal, rejected: the word)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 20)))
            f.write(json.dumps({"prompt": f"reverse {word}:", "chosen": word[::-1], "rejected": word}) + "\n")
    return path


def dpo_recipe(tmp: Path, **sections) -> Path:
    """A tiny dpo recipe on 40 pairs (4 held out), its cache in ``tmp/../cache`` (shared by a test's runs)."""
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp.parent / "pairs.jsonl"
    if not data.exists():
        write_pairs(data)
    base = dict(
        data__train=str(data),
        data__cache_dir=str(tmp.parent / "cache"),
        data__eval_fraction=0.1,
        train__objective="dpo",
        train__max_steps=4,
        train__eval_every_steps=2,
        batch__global_batch_size=8,
        batch__micro_batch_size=2,
        optim__name="adamw",
        optim__lr=1e-2,
        peft__r=4,
    )
    return write_recipe(tmp, **{**base, **sections})


def reference_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/reference/*/*.npy"))


def final_weights(test_dir: Path) -> dict[str, torch.Tensor]:
    """The trainable weights of the last checkpoint of the run under ``test_dir`` (``<dir>/run``), any engine."""
    return trainable_state(load_checkpoint_model(test_dir / "run")[0])


def assert_same_run(a: Path, b: Path, tol: float = TOL) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=tol), k
    for split in ("train", "eval"):
        ra, rb = metrics(a / "run", split), metrics(b / "run", split)
        assert len(ra) == len(rb) > 0
        for x, y in zip(ra, rb, strict=True):
            for key in ("loss", "rewards/chosen", "rewards/margin", "rewards/accuracy", "logps/rejected"):
                assert abs(x[key] - y[key]) <= tol * max(1.0, abs(y[key])), (split, key)
