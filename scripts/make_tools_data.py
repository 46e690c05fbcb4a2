"""Write the tool-calling quickstart's data: data/quickstart-tools/sft-train.jsonl (chat transcripts
for a short SFT stage) and prompts-{train,eval}.jsonl (prompt records for GRPO with a tool).

The task is a product of a 3-digit and a 2-digit number, "347*29=?", which the ~0.4M-parameter
byte-level Llama of configs/quickstart-tools-sft.yaml cannot learn to compute but can answer by
calling the calculator (examples/tools/calculator.py: ``multiply(a, b)``) and copying its result.
A transcript that uses the tool:

    {"messages": [{"content": "347*29=?", "role": "user"},
                  {"content": "", "role": "assistant", "tool_calls": [{"function": {"arguments":
                      {"a": 347, "b": 29}, "name": "multiply"}, "type": "function"}]},
                  {"content": "10063", "name": "multiply", "role": "tool"},
                  {"content": "10063", "role": "assistant"}]}

and one that answers from memory (right in the transcript, but a guess for the model):

    {"messages": [{"content": "347*29=?", "role": "user"}, {"content": "10063", "role": "assistant"}]}

The SFT mix leaves room for RL: the transcripts answer from memory DIRECT_SMALL (75%) of the
products whose first factor is below SPLIT (600) and DIRECT_LARGE (10%) of the others, 46% in all.
After SFT the model calls the tool for the large first factors and answers most small ones from
memory (wrongly, on held-out products): greedy held-out success about one half, while at
temperature 1 it still calls the tool on about a quarter of the small ones, so GRPO, rewarded on
the right answer, has samples that show the tool paying off (scripts/tools_baseline.py measures
this). With direct answers drawn independently of the prompt, every prompt would get about the
same tool probability, and greedy decoding would mostly take whichever choice is more likely.

The prompt records of GRPO hold the question as messages and the product as ``answer`` (the field
examples/rewards/arithmetic.py reads):

    {"answer": "10063", "prompt": [{"content": "347*29=?", "role": "user"}]}

No product (pair of factors) occurs twice across the three files: the eval pairs are held out from
SFT and from RL training. Keys are sorted, so a tool call renders with the llmft chat template as
``[{"function": {"arguments": {"a": 347, "b": 29}, "name": "multiply"}, "type": "function"}]``
(the template's ``tojson`` keeps the message's key order).

Deterministic: stdlib only, a fixed seed, sorted keys, "\\n" line ends; rerunning rewrites the
files byte for byte.

    python scripts/make_tools_data.py [--out data/quickstart-tools]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SEED = 4321
A_RANGE, B_RANGE = (100, 999), (10, 99)  # 81,000 pairs
SPLIT = 600  # first factors below it are the ones the transcripts mostly answer from memory
DIRECT_SMALL, DIRECT_LARGE = 0.75, 0.1
NUM_SFT, NUM_PROMPTS_TRAIN, NUM_PROMPTS_EVAL = 6000, 2000, 200
TOOL = "multiply"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "quickstart-tools"


def question(a: int, b: int) -> str:
    return f"{a}*{b}=?"


def draw_pairs(num: int, rng: random.Random, taken: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """``num`` factor pairs that are all new (not in ``taken``, which is updated)."""
    pairs = []
    while len(pairs) < num:
        pair = (rng.randint(*A_RANGE), rng.randint(*B_RANGE))
        if pair in taken:
            continue
        taken.add(pair)
        pairs.append(pair)
    return pairs


def transcript(a: int, b: int, use_tool: bool) -> dict[str, Any]:
    """A chat record: the question, then the tool call, its result and the answer, or the answer alone."""
    answer = str(a * b)
    user = {"role": "user", "content": question(a, b)}
    if not use_tool:
        return {"messages": [user, {"role": "assistant", "content": answer}]}
    call = {"type": "function", "function": {"name": TOOL, "arguments": {"a": a, "b": b}}}
    return {
        "messages": [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": TOOL, "content": answer},
            {"role": "assistant", "content": answer},
        ]
    }


def sft_records(pairs: list[tuple[int, int]], rng: random.Random) -> list[dict[str, Any]]:
    records = []
    for a, b in pairs:
        direct = rng.random() < (DIRECT_SMALL if a < SPLIT else DIRECT_LARGE)
        records.append(transcript(a, b, use_tool=not direct))
    return records


def prompt_records(pairs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The prompt records of GRPO: the question as messages, the product as ``answer``."""
    return [{"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a * b)} for a, b in pairs]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in records)
    path.write_bytes(text.encode("ascii"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the tool-calling quickstart's data (products, a calculator).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    out = parser.parse_args(argv).out
    rng = random.Random(SEED)
    taken: set[tuple[int, int]] = set()
    # Eval first, so that changing the train sizes never changes the held-out set.
    eval_pairs = draw_pairs(NUM_PROMPTS_EVAL, rng, taken)
    sft_pairs = draw_pairs(NUM_SFT, rng, taken)
    rl_pairs = draw_pairs(NUM_PROMPTS_TRAIN, rng, taken)
    sft = sft_records(sft_pairs, rng)
    write_jsonl(out / "sft-train.jsonl", sft)
    write_jsonl(out / "prompts-train.jsonl", prompt_records(rl_pairs))
    write_jsonl(out / "prompts-eval.jsonl", prompt_records(eval_pairs))
    direct = sum(len(r["messages"]) == 2 for r in sft)
    print(
        f"wrote {len(sft)} SFT transcripts ({direct} answered without the tool), "
        f"{len(rl_pairs)} train and {len(eval_pairs)} eval prompts to {out}"
    )


if __name__ == "__main__":
    main()
