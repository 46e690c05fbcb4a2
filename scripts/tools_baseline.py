"""Measure how an exported model of the tool-calling quickstart uses the calculator on held-out
products (data/quickstart-tools/prompts-eval.jsonl): the starting point of GRPO with tools.

    python scripts/tools_baseline.py runs/quickstart-tools-sft-model [--num 100] [--samples 8]

Each prompt is rendered with the model's chat template (the llmft template after
configs/quickstart-tools-sft.yaml) with the generation prompt, and the first assistant turn is
generated with transformers ``generate``. A turn is a tool call when it starts with "[", and a
well-formed one when it is exactly what the template writes for the parsed calls: the JSON list
``[{"function": {"arguments": {"a": 347, "b": 29}, "name": "multiply"}, "type": "function"}]``.
A well-formed call is executed (examples/tools/calculator.py), its result appended as a tool
message, the conversation rendered again and the second turn generated: its text is the final
answer. A turn that is not a tool call is the final answer itself. Reported, greedy:

- ``tool``: the share of prompts whose first turn is a tool call, and ``well_formed`` the share of
  those calls that are well-formed (``args_right``: that also name the prompt's two factors);
- ``success``: the share of prompts whose final answer is the product (the mean reward of
  examples/rewards/arithmetic.py), where GRPO's greedy held-out eval starts;
- ``success_forced_tool`` and ``success_forced_direct``: the same with every first turn forced to
  a tool call (its first token fixed to "[") or to a direct answer ("[" banned as first token):
  what the tool is worth on these prompts;

each also for first factors below and above 500 (the SFT transcripts answer most of the former
from memory). With ``--samples G`` > 0, G episodes per prompt sampled at temperature 1 as GRPO's
rollouts are: the share of samples that call the tool and their mean success.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples" / "tools"), str(ROOT / "examples" / "rewards")]
from arithmetic import correct  # noqa: E402 - the example folders are not packages
from calculator import multiply  # noqa: E402

TOOLS = {"multiply": multiply}
SPLIT = 600  # scripts/make_tools_data.py: first factors below it are mostly answered from memory


def parse_call(text: str) -> list[dict[str, Any]] | None:
    """The tool calls of a first turn, or None when it is not exactly what the template writes for them."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    ok = (
        isinstance(calls, list)
        and len(calls) >= 1
        and all(
            isinstance(c, dict)
            and list(c) == ["function", "type"]
            and c["type"] == "function"
            and isinstance(c["function"], dict)
            and list(c["function"]) == ["arguments", "name"]
            and isinstance(c["function"]["arguments"], dict)
            for c in calls
        )
    )
    return calls if ok and json.dumps(calls) == text else None


def run_tool(call: dict[str, Any]) -> str:
    fn = TOOLS.get(call["function"]["name"])
    if fn is None:
        return json.dumps({"error": f"Tool {call['function']['name']} not found."})
    try:
        return str(fn(**call["function"]["arguments"]))
    except Exception as e:  # noqa: BLE001 - what the model called with is arbitrary; the error is the result
        return json.dumps({"error": str(e)})


class Generator:
    def __init__(self, model_dir: str, seed: int) -> None:
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.bracket = self.tok.convert_tokens_to_ids(self.tok.tokenize("[")[0])
        torch.manual_seed(seed)

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def turns(self, texts: list[str], sample: bool, max_new_tokens: int, ban_bracket: bool = False) -> list[str]:
        """One assistant turn after each rendered text, decoded up to its eos (not included)."""
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs: dict[str, Any] = {"do_sample": sample, "max_new_tokens": max_new_tokens}
        kwargs.update({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {})
        if ban_bracket:  # no tool call: the first generated token may not be "["
            start = enc["input_ids"].shape[1]
            ban = self.bracket

            def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
                if len(ids) == start:
                    return [i for i in range(len(self.tok)) if i != ban]
                return list(range(len(self.tok)))

            kwargs["prefix_allowed_tokens_fn"] = allowed
        out = self.model.generate(
            **enc, pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id, **kwargs
        )
        new = out[:, enc["input_ids"].shape[1] :]
        texts_out = []
        for row in new.tolist():
            if self.tok.eos_token_id in row:
                row = row[: row.index(self.tok.eos_token_id)]
            texts_out.append(self.tok.decode(row, skip_special_tokens=False))
        return texts_out

    def episodes(self, prompts: list[dict[str, Any]], sample: bool, force: str | None = None) -> list[dict[str, Any]]:
        """One episode per prompt record: the first turn, the tool's result and the final answer."""
        firsts_in = [self.render(p["prompt"]) + ("[" if force == "tool" else "") for p in prompts]
        firsts = self.turns(firsts_in, sample, max_new_tokens=120, ban_bracket=force == "direct")
        if force == "tool":
            firsts = ["[" + t for t in firsts]
        results: list[dict[str, Any]] = []
        follow_up = []
        for p, first in zip(prompts, firsts, strict=True):
            calls = parse_call(first) if first.startswith("[") else None
            a, b = (int(x) for x in p["prompt"][-1]["content"].removesuffix("=?").split("*"))
            r = {"a": a, "first": first, "tool": first.startswith("["), "well_formed": calls is not None}
            r["args_right"] = bool(calls) and calls[0]["function"]["arguments"] == {"a": a, "b": b}
            r["final"] = first if not r["tool"] else ""
            if calls is not None:
                msgs = [
                    *p["prompt"],
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    *({"role": "tool", "name": c["function"]["name"], "content": run_tool(c)} for c in calls),
                ]
                follow_up.append((len(results), self.render(msgs)))
            results.append(r)
        if follow_up:
            seconds = self.turns([t for _, t in follow_up], sample, max_new_tokens=8)
            for (i, _), text in zip(follow_up, seconds, strict=True):
                results[i]["final"] = text
        for p, r in zip(prompts, results, strict=True):
            r["success"] = correct(p["prompt"], r["final"], p["answer"]) == 1.0
        return results


def rate(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / max(len(rows), 1)


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The shares of ``rows`` as in the module docstring, overall and per side of the split."""
    calls = [r for r in rows if r["tool"]]
    out = {
        "tool": rate(rows, "tool"),
        "well_formed": rate(calls, "well_formed"),
        "args_right": rate(calls, "args_right"),
        "success": rate(rows, "success"),
    }
    for name, part in (("small", [r for r in rows if r["a"] < SPLIT]), ("large", [r for r in rows if r["a"] >= SPLIT])):
        out[f"tool_{name}"] = rate(part, "tool")
        out[f"success_{name}"] = rate(part, "success")
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an exported model dir (llmft export)")
    parser.add_argument("--prompts", default=str(ROOT / "data" / "quickstart-tools" / "prompts-eval.jsonl"))
    parser.add_argument("--num", type=int, default=100, help="the first NUM prompt records (default 100)")
    parser.add_argument("--samples", type=int, default=8, help="episodes per prompt at temperature 1 (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print the first SHOW greedy episodes")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()][: args.num]
    gen = Generator(args.model, args.seed)
    greedy = gen.episodes(prompts, sample=False)
    report: dict[str, Any] = {"prompts": len(prompts), "greedy": summary(greedy)}
    report["success_forced_tool"] = summary(gen.episodes(prompts, sample=False, force="tool"))["success"]
    report["success_forced_direct"] = summary(gen.episodes(prompts, sample=False, force="direct"))["success"]
    if args.samples:
        sampled = gen.episodes([p for p in prompts for _ in range(args.samples)], sample=True)
        report[f"sampled_t1_x{args.samples}"] = summary(sampled)
    for r in greedy[: args.show]:
        print(f"  {r['a']}: {r['first']!r} -> {r['final']!r} success={r['success']}")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
