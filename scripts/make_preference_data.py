"""Write the preference demo's pairs: data/preference/{train,eval}.jsonl, from the quickstart task.

Each quickstart record (``scripts/make_quickstart_data.py``: reverse a short word) becomes a
pair whose chosen completion is the correct reversal and whose rejected one is a plausible
wrong answer, so that a model fresh from the SFT quickstart (or a short SFT) has to learn to
prefer the exact reversal:

    {"prompt": "reverse: cabd\\n", "chosen": "dbac", "rejected": "dabc"}

The wrong answers, in turn (by record index), so that no single trick separates them:

- the word itself, unreversed (the "copy" mistake);
- the reversal with two neighbouring letters swapped (a near miss);
- the reversal with one letter replaced by another letter of the alphabet (a near miss).

A wrong answer always differs from the right one (a palindrome never gets the copy mistake).
Train pairs are made from the quickstart's train words and eval pairs from its eval words, so
a held-out pair's word was never trained on by the SFT quickstart either.

Deterministic: stdlib only, a fixed seed, sorted keys, "\\n" line ends; rerunning rewrites the
files byte for byte.

    python scripts/make_preference_data.py [--quickstart data/quickstart] [--out data/preference]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 4321
ALPHABET = "abcdefgh"  # the quickstart's letters
ROOT = Path(__file__).resolve().parents[1] / "data"
PROMPT = "reverse: "


def wrong_answer(word: str, kind: int, rng: random.Random) -> str:
    """A plausible wrong reversal of ``word``: never the right one."""
    right = word[::-1]
    if kind == 0 and word != right:
        return word
    if kind <= 1 and len(set(right)) > 1:
        # swap two neighbouring letters that differ (swapping equal letters changes nothing)
        spots = [i for i in range(len(right) - 1) if right[i] != right[i + 1]]
        i = rng.choice(spots)
        return right[:i] + right[i + 1] + right[i] + right[i + 2 :]
    i = rng.randrange(len(right))
    letter = rng.choice([c for c in ALPHABET if c != right[i]])
    return right[:i] + letter + right[i + 1 :]


def make_pairs(records: list[dict[str, str]], rng: random.Random) -> list[dict[str, str]]:
    pairs = []
    for k, record in enumerate(records):
        prompt = record["prompt"]
        assert prompt.startswith(PROMPT) and prompt.endswith("\n"), prompt
        word = prompt[len(PROMPT) : -1]
        chosen = record["completion"]
        assert chosen == word[::-1], record
        rejected = wrong_answer(word, k % 3, rng)
        assert rejected != chosen
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in records)
    path.write_bytes(text.encode("ascii"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the preference demo's pairs (prefer the right reversal).")
    parser.add_argument("--quickstart", type=Path, default=ROOT / "quickstart", help="the quickstart data dir")
    parser.add_argument("--out", type=Path, default=ROOT / "preference", help="output directory")
    args = parser.parse_args(argv)
    rng = random.Random(SEED)
    for split in ("train", "eval"):
        pairs = make_pairs(read_jsonl(args.quickstart / f"{split}.jsonl"), rng)
        write_jsonl(args.out / f"{split}.jsonl", pairs)
        print(f"wrote {len(pairs)} {split} pairs to {args.out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
