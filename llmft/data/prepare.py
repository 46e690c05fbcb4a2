"""``llmft prepare``: tokenize and pack a recipe's data into the cache ahead of training (e.g. on a CPU node).

``llmft train`` with the same data settings then finds every entry and starts
without tokenizing; with other settings it builds a new entry and logs which
setting differs from the prepared one (``cache.explain_miss``).
"""

from __future__ import annotations

import logging
import sys
import time

from llmft.data.build import build_data, cache_root
from llmft.data.kinds import kind_code
from llmft.data.tokenizer import load_tokenizer
from llmft.errors import Problem, UserError
from llmft.plan.kinds import kind_spec
from llmft.plan.objectives import objective_of
from llmft.plan.resolve import load_plan
from llmft.recipe import load_recipe
from llmft.stop import StopRequest


def prepare(recipe_path: str, overrides: list[str]) -> str:
    """Build (or find) the cache entries of the recipe's data; the report to print."""
    _log_to_stderr()
    recipe = load_recipe(recipe_path, overrides)
    if recipe.data.max_seq_len == "auto":  # the planner picks it, as llmft train does for the same layout
        recipe = load_plan(recipe_path, overrides).recipe
    if recipe.data.streaming:
        raise UserError(
            Problem(
                "data.streaming",
                "is true: a streamed run tokenizes data.train as it trains, so there is nothing to prepare",
                "Set data.streaming=false to build the token cache ahead of training.",
            )
        )
    started = time.time()
    tokenizer = load_tokenizer(recipe.model)
    # A stop request (a scheduler's SIGTERM, Ctrl-C) ends the build within seconds with exit 75;
    # the shards it finished are kept, so the same command continues from them.
    stop = StopRequest(recipe.distributed.stop_signal).install()
    try:
        data = build_data(recipe, tokenizer)
    finally:
        stop.uninstall()
    lines = [f"data cache: {cache_root(recipe.data)} ({time.time() - started:.1f} s)"]
    kind = kind_spec(objective_of(recipe).record)  # what an entry's rows are: its own words
    for e in data.entries:
        s = e["stats"]
        how = "built" if e["built"] else "already there"
        lines.append(f"{e['key']}: {e['source']}")
        lines.append(f"  entry {e['entry']} ({how}, {_size(e['bytes'])})")
        detail = "  " + kind_code(kind).describe(s)
        if "packing_efficiency" in s:
            detail += f", packing efficiency {s['packing_efficiency']:.1%}"
        lines.append(detail)
        notes = [f"{s[k]:,} {what}" for k, what in _NOTES if s.get(k)]
        if notes:
            lines.append("  " + ", ".join(notes))
    st = data.stats
    total = f"train: {st['rows']:,} {kind.unit} of max_seq_len {recipe.data.max_seq_len}, {st['tokens']:,} tokens"
    if "group" in st:
        total += f", {st['group']} completions per prompt"
    if "mixture_rows" in st:
        total += f"; {st['mixture_rows']:,} rows per epoch after weights"
    lines.append(total)
    if "eval" in st:
        lines.append(
            f"eval: {st['eval']['rows']:,} rows, {st['eval']['tokens']:,} tokens, {st['eval']['prompts']} prompts"
        )
    return "\n".join(lines)


def _log_to_stderr() -> None:
    log = logging.getLogger("llmft")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[llmft] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


_NOTES = (
    ("truncated", "truncated to max_seq_len"),
    ("dropped_no_targets", "dropped (no target left)"),
    ("skipped", "malformed, skipped"),
)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
