"""Write the quickstart data set: data/quickstart/{train,eval}.jsonl and the same words as prompt
records for online RL, data/quickstart/prompts-{train,eval}.jsonl.

A synthetic task that a ~0.4M-parameter byte-level Llama (configs/quickstart.yaml)
learns on two CPU cores in under a minute, so that the quickstart shows a
falling loss and an exact-match accuracy that climbs from 0 to 1.0 (by step ~750 of 1000):

    {"prompt": "reverse: cabd\\n", "completion": "dbac"}

Words are 3-6 letters drawn from a small alphabet (a-h), so the model spends its
capacity on the rule rather than on the vocabulary: with all 26 letters the same
model reached only ~0.2 in the same number of steps. (A "copy" task was tried as
an easier warm-up and learned more slowly than reverse: with 8 letters, repeats
make "find the previous letter and take the next one" ambiguous.) Eval prompts
never occur in train.

The prompt records of configs/quickstart-grpo.yaml hold the same prompts with the reversal as
``answer`` (the field its reward functions read, examples/rewards/reversal.py):

    {"answer": "dbac", "prompt": "reverse: cabd\\n"}

Deterministic: stdlib only, a fixed seed, sorted keys, "\\n" line ends; rerunning
rewrites the files byte for byte.

    python scripts/make_quickstart_data.py [--out data/quickstart]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 6
NUM_TRAIN, NUM_EVAL = 3000, 200
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "quickstart"


def make_records(num: int, rng: random.Random, taken: set[str]) -> list[dict[str, str]]:
    """``num`` records whose words are all new (not in ``taken``, which is updated)."""
    records = []
    while len(records) < num:
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        if word in taken:
            continue
        taken.add(word)
        records.append({"prompt": f"reverse: {word}\n", "completion": word[::-1]})
    return records


def prompt_records(records: list[dict[str, str]]) -> list[dict[str, str]]:
    """The prompt records of online RL: each prompt, its completion as ``answer``."""
    return [{"prompt": r["prompt"], "answer": r["completion"]} for r in records]


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in records)
    path.write_bytes(text.encode("ascii"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the quickstart data set (reverse a short word).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    out = parser.parse_args(argv).out
    rng = random.Random(SEED)
    taken: set[str] = set()
    # Eval first, so that changing NUM_TRAIN never changes the held-out set.
    eval_records = make_records(NUM_EVAL, rng, taken)
    train_records = make_records(NUM_TRAIN, rng, taken)
    write_jsonl(out / "train.jsonl", train_records)
    write_jsonl(out / "eval.jsonl", eval_records)
    write_jsonl(out / "prompts-train.jsonl", prompt_records(train_records))
    write_jsonl(out / "prompts-eval.jsonl", prompt_records(eval_records))
    print(f"wrote {len(train_records)} train and {len(eval_records)} eval records (and as prompts) to {out}")


if __name__ == "__main__":
    main()
