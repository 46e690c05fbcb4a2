"""Bounded memory per preference pair: a pair's texts are cut before the tokenizer sees them (the
prompt from the left, as ``truncate_pair`` keeps its last tokens; the completions from the right),
and the cache rows (ids, targets, which pairs are truncated or dropped) are exactly those of the
uncut pairs: string and chat pairs, around the budget and far past it, on the byte tokenizer and on
a trained byte-level BPE. A 50 MB chosen text or prompt costs what a short pair costs."""

from __future__ import annotations

import json
import random
import tracemalloc

import numpy as np
import pytest
from helpers import data_recipe
from test_data_record_bound import TOKENIZERS, Seen, text_of

from llmft.data import build_data
from llmft.data.encode import text_budget
from llmft.data.kinds import make_encoder
from llmft.data.kinds.pairs import PairEncoder, build_pair_rows, parse_pair
from llmft.data.tokenizer import byte_tokenizer
from llmft.plan.objectives import objective_spec
from llmft.recipe.schema import Recipe

L = 32  # max_seq_len
WORDS = "abcdeéfg  \n€"  # text_of's alphabet: words, space runs, newlines


def rows_of(examples, max_len: int = L):
    """``build_pair_rows`` of encoded pairs: each pair's four lists (chosen/rejected ids and labels)
    and the stats (truncated, dropped_no_targets, tokens, target_tokens)."""
    ids = np.concatenate([e.input_ids for e in examples])
    target = np.concatenate([e.target_mask() for e in examples])
    offsets = np.concatenate([[0], np.cumsum([len(e.input_ids) for e in examples])]).astype(np.int64)
    cfg = Recipe().data
    cfg.max_seq_len = max_len
    ds, stats = build_pair_rows(ids, target, offsets, np.arange(len(examples)), cfg, "data.train", allow_empty=True)
    got = [tuple(ds[i][s][k].tolist() for s in ("chosen", "rejected") for k in ("input_ids", "labels"))
           for i in range(len(ds))]  # fmt: skip
    return got, stats


def lengths(budget: int, span: int) -> list[int]:
    return [1, L // 2, L - 1, L + 1, 3 * L, budget - 1, budget, budget + 1, budget + span + 3, 4 * budget]


def string_pairs(budget: int, span: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    sizes = lengths(budget, span)
    for n in sizes:
        out.append({"prompt": text_of(rng, n), "chosen": text_of(rng, 5), "rejected": text_of(rng, 9)})
        out.append({"prompt": text_of(rng, 7), "chosen": text_of(rng, n), "rejected": text_of(rng, 3)})
        out.append({"prompt": text_of(rng, n), "chosen": text_of(rng, rng.choice(sizes)), "rejected": text_of(rng, n)})
        out.append({"prompt": "a" * n, "chosen": "b" * n, "rejected": "c"})  # one long word: no safe left cut
        out.append({"prompt": "x " * n, "chosen": "y", "rejected": "y" * n})  # a boundary every 2 characters
    for _ in range(20):  # random sizes near the budget and the cut's search span
        n = budget + rng.randint(-span, 2 * span)
        out.append({"prompt": text_of(rng, n), "chosen": text_of(rng, rng.randint(1, 2 * L)), "rejected": "r"})
    return out


def chat_pairs(budget: int, span: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in lengths(budget, span):
        prompt = [{"role": "system", "content": text_of(rng, 3)}, {"role": "user", "content": text_of(rng, n)}]
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": text_of(rng, 4)}],
                    "rejected": [{"role": "assistant", "content": text_of(rng, n)}]})  # fmt: skip
        out.append(
            {
                "chosen": prompt + [{"role": "assistant", "content": text_of(rng, n)}],
                "rejected": prompt + [{"role": "assistant", "content": text_of(rng, 2)}],
            }
        )  # implicit prompt
        turns = [{"role": r, "content": text_of(rng, rng.randint(1, 40))} for r in ["user", "assistant"] * 40]
        out.append(
            {
                "prompt": turns + [{"role": "user", "content": text_of(rng, n // 3)}],
                "chosen": [{"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "assistant", "content": text_of(rng, n)}],
            }
        )  # many turns, assistant ones in the prompt
        out.append(
            {
                "prompt": [{"role": "user", "content": "q"}],  # the completion begins with a user turn
                "chosen": [{"role": "user", "content": text_of(rng, n)}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": text_of(rng, n)}, {"role": "assistant", "content": "b"}],
            }
        )
        out.append({"prompt": [{"role": "user", "content": "a" * n}],
                    "chosen": [{"role": "assistant", "content": "b" * n}],
                    "rejected": [{"role": "assistant", "content": "c"}]})  # fmt: skip
    return out


def encoders(name: str, train_on: str) -> tuple[PairEncoder, PairEncoder]:
    tok = TOKENIZERS[name]()
    return make_encoder(tok, train_on, objective_spec("dpo"), L), PairEncoder(
        tok, train_on, "dpo"
    )  # the build's, and uncut


@pytest.mark.parametrize("kind", ["strings", "chats"])
@pytest.mark.parametrize("train_on", ["completion", "all"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_cut_pairs_give_the_rows_of_the_whole_pairs(name, train_on, kind, monkeypatch):
    cut, whole = encoders(name, train_on)
    budget, span = cut.max_chars, cut.span
    assert budget == text_budget(cut.encoder.tokenizer, L)
    records = (string_pairs if kind == "strings" else chat_pairs)(budget, span, seed=len(name) + len(train_on))
    pairs = [parse_pair(p, None, "dpo") for p in records]
    got, want = cut.encode_batch(pairs), whole.encode_batch(pairs)
    assert all(type(g).__name__ == "PairExample" for g in got + want)
    for max_len in (L, L - 1):  # and a shorter max_seq_len than the cut's: still exact
        (rows_got, stats_got), (rows_want, stats_want) = rows_of(got, max_len), rows_of(want, max_len)
        assert stats_got == stats_want and rows_got == rows_want
    assert stats_want["truncated"] > len(pairs) // 2 and stats_want["dropped_no_targets"] < len(pairs)
    # a prompt of one long word (no space to cut at) goes whole; what the tokenizer sees of the other
    # pairs is bounded by the budget (a text each, or the budget before and after a conversation's
    # targets), not by the texts (4x the budget)
    shortest = budget + 1 if kind == "strings" else budget - 1  # a rendered prompt adds its template's text
    word = ["a" * shortest in json.dumps(r) for r in records]
    assert cut.whole == (sum(word) if train_on == "completion" else 0) and sum(word) >= 2
    seen = Seen(monkeypatch)
    cut.encode_batch([p for p, w in zip(pairs, word, strict=True) if train_on == "all" or not w])
    assert seen.longest <= (1 if kind == "strings" or train_on == "all" else 2) * budget, seen.longest


@pytest.mark.parametrize("kind", ["strings", "chats"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_tokenizer_never_sees_more_than_the_budget(name, kind, monkeypatch):
    cut, whole = encoders(name, "completion")
    budget = text_budget(whole.encoder.tokenizer, L)
    rng = random.Random(7)
    big = [text_of(rng, 50 * budget) for _ in range(3)]
    if kind == "strings":
        records = [
            {"prompt": big[0], "chosen": big[1], "rejected": "no"},
            {"prompt": "p", "chosen": "c", "rejected": big[2]},
        ]
    else:
        records = [
            {"prompt": [{"role": "user", "content": big[0]}], "chosen": [{"role": "assistant", "content": big[1]}],
             "rejected": [{"role": "assistant", "content": "no"}]},
            {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": big[2]}],
             "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]},
        ]  # fmt: skip
    pairs = [parse_pair(r, None, "dpo") for r in records]
    want = rows_of(whole.encode_batch(pairs))
    seen = Seen(monkeypatch)
    got = rows_of(cut.encode_batch(pairs))
    # strings: each text at most the budget; a conversation: the budget before and after where its targets begin
    assert seen.longest == budget if kind == "strings" else budget < seen.longest <= 2 * budget, seen.longest
    assert got == want and cut.whole == 0


def peak_of(fn) -> int:
    """Peak bytes Python allocated while ``fn`` ran (tracemalloc: in this process, no child process)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


HUGE = 50 << 20  # a 50 MB text


@pytest.mark.parametrize("where", ["chosen", "prompt"])
@pytest.mark.parametrize("kind", ["strings", "chats"])
def test_a_50_mb_text_in_a_pair_costs_bounded_memory(kind, where):
    """Tokenized whole, a 50 MB text is ~50 M ids in a Python list (0.4 GB and more); cut, the ids are
    a short pair's. What remains is the text itself and, for a conversation's prompt, its renderings
    (chosen's and rejected's, one at a time while rendered: ~3x the text)."""
    tok = byte_tokenizer()
    enc = make_encoder(tok, "completion", objective_spec("dpo"), L)
    text = ("lorem ipsum " * (HUGE // 12 + 1))[:HUGE]
    record = {"prompt": "p", "chosen": "c", "rejected": "r"}
    record[where] = text
    if kind == "chats":
        record = {k: [{"role": "user" if k == "prompt" else "assistant", "content": v}] for k, v in record.items()}
    pair = parse_pair(record, None, "dpo")
    out: list = []
    peak = peak_of(lambda: out.extend(enc.encode_batch([pair])))
    rendered = HUGE if (kind, where) == ("chats", "prompt") else 0  # the template's output, a string
    assert peak < 3 * rendered + (8 << 20), peak
    (ex,) = out
    rows, stats = rows_of([ex])
    assert stats["truncated"] == 1 and enc.whole == 0 and len(ex.input_ids) < 4 * enc.max_chars
    chosen = tok.decode([t for t in rows[0][1] if t >= 0], skip_special_tokens=True)  # the chosen row's targets
    if where == "chosen":
        assert chosen.startswith("lorem ipsum lorem") and len(rows[0][0]) == L


def test_the_cache_of_huge_pairs_equals_the_uncut_rows(tmp_path, monkeypatch):
    """The whole build (stats, rows, held-out rows, eval prompts) with the cut equals it without."""
    rng = random.Random(8)
    big = lambda: text_of(rng, 30_000)  # noqa: E731
    recs = [
        {"prompt": big(), "chosen": "yes", "rejected": "no"},
        {"prompt": "q", "chosen": big(), "rejected": "no"},
        {"prompt": [{"role": "user", "content": big()}], "chosen": [{"role": "assistant", "content": "a"}],
         "rejected": [{"role": "assistant", "content": big()}]},
        {"prompt": "short", "chosen": "yes", "rejected": "no"},
    ]  # fmt: skip
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs * 3))

    def build(cache):
        r = data_recipe(tmp_path, str(path), max_seq_len=L, eval_fraction=0.25)
        r.train.objective, r.data.cache_dir = "dpo", str(cache)
        return build_data(r, byte_tokenizer())

    cut = build(tmp_path / "cut")
    monkeypatch.setattr(PairEncoder, "encode_batch", lambda self, pairs: self._encode(pairs, self.encoder))
    whole = build(tmp_path / "whole")
    assert cut.stats == whole.stats and cut.stats["truncated"] == 6, cut.stats
    for a, b in ((cut.train, whole.train), (cut.eval, whole.eval)):
        assert len(a) == len(b) and a.rows.num_tokens == b.rows.num_tokens
        for i in range(len(a)):
            for side in ("chosen", "rejected"):
                assert a[i][side]["input_ids"].tolist() == b[i][side]["input_ids"].tolist()
                assert a[i][side]["labels"].tolist() == b[i][side]["labels"].tolist()
    assert [p.tolist() for p, _ in cut.eval_prompts] == [p.tolist() for p, _ in whole.eval_prompts]
