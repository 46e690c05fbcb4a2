"""Bounded memory per record: a text longer than ``max_chars`` is cut before the tokenizer sees it,
and the record's first ``max_seq_len`` tokens and targets are exactly those of the uncut record
(text, prompt/completion and chat records, around the cut and far past it, on the byte tokenizer
and on a trained byte-level BPE with merges and GPT-2's pre-tokenizer regex)."""

import json
import random

import numpy as np
import pytest

from llmft.data import build_data
from llmft.data.encode import CUT_MARGIN, Encoder, max_token_chars
from llmft.data.records import parse_record
from llmft.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer
from llmft.recipe.schema import Recipe

L = 32  # max_seq_len


def bpe_tokenizer():
    """A byte-level BPE trained here (merges up to 12-byte tokens), with the byte tokenizer's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdeéfg ") for _ in range(rng.randint(1, 12))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", "<eos>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


TOKENIZERS = {"byte": byte_tokenizer, "bpe": bpe_tokenizer}


def text_of(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdeéfg  \n€") for _ in range(n))


def records(max_chars: int) -> list[dict]:
    rng = random.Random(1)
    out = []
    for n in [
        1,
        L - 1,
        L,
        L + 1,
        max_chars - 2,
        max_chars - 1,
        max_chars,
        max_chars + 1,
        max_chars + 2,
        10 * max_chars,
    ]:
        out.append({"text": text_of(rng, n)})
        out.append({"text": "a" * n})  # one long word: the cut splits it
        out.append({"prompt": text_of(rng, n), "completion": text_of(rng, 5)})
        out.append({"prompt": text_of(rng, 5), "completion": text_of(rng, n)})
        out.append(
            {
                "messages": [
                    {"role": "system", "content": text_of(rng, 3)},
                    {"role": "user", "content": text_of(rng, n)},
                    {"role": "assistant", "content": text_of(rng, n)},
                ]
            }
        )
        out.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text_of(rng, n)}]})
    return out


@pytest.mark.parametrize("train_on", ["completion", "all"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_cut_record_keeps_the_first_max_seq_len_tokens_of_the_whole_one(name, train_on):
    tok = TOKENIZERS[name]()
    cut, whole = Encoder(tok, train_on, L), Encoder(tok, train_on)
    assert cut.max_chars == (L + CUT_MARGIN) * max_token_chars(tok)
    recs = [parse_record(r, {}) for r in records(cut.max_chars)]
    got, want = cut.encode_batch(recs), whole.encode_batch(recs)
    longest = 0
    for g, w, r in zip(got, want, recs, strict=True):
        assert g.input_ids[:L].tolist() == w.input_ids[:L].tolist(), r
        assert g.labels[:L].tolist() == w.labels[:L].tolist(), r
        assert (len(g.input_ids) > L) == (len(w.input_ids) > L)  # counted as truncated alike
        longest = max(longest, len(g.input_ids))
    # what the tokenizer saw is bounded by the budget, not by the 10x records (3 texts in a chat)
    assert longest <= 3 * 4 * cut.max_chars + 64 < 10 * cut.max_chars * 3


def test_the_cache_of_huge_records_equals_the_uncut_rows(tmp_path, monkeypatch):
    """The whole build (truncation stats, rows, eval prompts) with the cut equals it without."""
    from llmft.data import encode

    rng = random.Random(2)
    path = tmp_path / "d.jsonl"
    recs = [{"text": text_of(rng, 20_000)}, {"prompt": text_of(rng, 9_000), "completion": "x"}]
    recs += [{"prompt": "p", "completion": text_of(rng, 30_000)}, {"text": "short"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs * 3))

    def build(cache):
        r = Recipe()
        r.data.train, r.data.cache_dir, r.data.max_seq_len, r.data.eval_fraction = str(path), str(cache), L, 0.25
        return build_data(r, byte_tokenizer())

    cut = build(tmp_path / "cut")
    monkeypatch.setattr(encode, "_cut", lambda record, max_chars: (record, False))
    whole = build(tmp_path / "whole")
    assert cut.stats == whole.stats and cut.stats["truncated"] == 6
    assert np.array_equal(cut.train._input_ids, whole.train._input_ids)
    assert np.array_equal(cut.train._target, whole.train._target)
    assert [p.tolist() for p, _ in cut.eval_prompts] == [p.tolist() for p, _ in whole.eval_prompts]
    max_chars = Encoder(byte_tokenizer(), "completion", L).max_chars
    assert [r for _, r in cut.eval_prompts] == [r[:max_chars] for _, r in whole.eval_prompts]  # a reference is cut too


def test_the_tokenizer_never_sees_more_than_the_budget(tmp_path, monkeypatch):
    seen = []
    real = Encoder._ids_batch

    def spy(self, texts, special):
        seen.extend(len(t) for t in texts)
        return real(self, texts, special)

    monkeypatch.setattr(Encoder, "_ids_batch", spy)
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"text": "ab " * 100_000}) + "\n" + json.dumps({"prompt": "q", "completion": "a" * 10**5})
    )
    r = Recipe()
    r.data.train, r.data.cache_dir, r.data.max_seq_len = str(path), str(tmp_path / "cache"), L
    data = build_data(r, byte_tokenizer())
    assert data.stats["truncated"] == 2 and data.stats["tokens"] == 2 * L
    assert max(seen) == Encoder(byte_tokenizer(), "all", L).max_chars < 10_000


def test_random_texts_around_the_cut_on_bpe():
    """Words of every length, space runs and newlines, cut anywhere within 80 characters of the budget."""
    tok = bpe_tokenizer()
    cut, whole = Encoder(tok, "all", L), Encoder(tok, "all")
    rng = random.Random(3)
    recs = []
    for _ in range(150):
        alphabet = rng.choice(["ab", "abcdeéfg ", "a \n", "abcdefg", "é€ a"])
        text = "".join(rng.choice(alphabet) for _ in range(cut.max_chars + rng.randint(-80, 80)))
        recs.append(parse_record({"text": text}, {}))
    for g, w in zip(cut.encode_batch(recs), whole.encode_batch(recs), strict=True):
        assert g.input_ids[:L].tolist() == w.input_ids[:L].tolist()


def many_messages(rng: random.Random, turns: int, tools: bool = False) -> dict:
    """A conversation of ``turns`` short exchanges (no message near the budget; together far past it),
    with tool calls (the prefix-render path) when ``tools``."""
    messages = [{"role": "system", "content": text_of(rng, 7)}]
    for t in range(turns):
        messages.append({"role": "user", "content": text_of(rng, rng.randint(1, 30))})
        if tools and t % 2:
            call = {"type": "function", "function": {"name": "f", "arguments": {"x": t}}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "content": text_of(rng, rng.randint(1, 20))})
        messages.append({"role": "assistant", "content": text_of(rng, rng.randint(1, 40))})
    return {"messages": messages}


class Seen:
    """The longest text given to the tokenizer (every call goes through ``encode.char_batches``)."""

    def __init__(self, monkeypatch):
        from llmft.data import encode

        self.longest, real = 0, encode.char_batches

        def spy(texts, budget):
            self.longest = max([self.longest, *map(len, texts)])
            return real(texts, budget)

        monkeypatch.setattr(encode, "char_batches", spy)


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("train_on", ["completion", "all"])
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_conversation_of_many_short_messages_is_cut_after_rendering(name, train_on, tools, monkeypatch):
    """The rendered conversation is cut to the budget before tokenizing (no message is long enough to be
    cut alone); the first max_seq_len tokens and targets are the uncut render's. Tool calls take the
    prefix renders, which stop at the first assistant message past the budget."""
    tok = TOKENIZERS[name]()
    cut, whole = Encoder(tok, train_on, L), Encoder(tok, train_on)
    rng = random.Random(4)
    recs = [parse_record(many_messages(rng, turns, tools), {}) for turns in (1, 3, 20, 120)]
    recs.append(parse_record(records(cut.max_chars)[-2], {}))  # a long message too
    want = whole.encode_batch(recs)
    seen, renders = Seen(monkeypatch), []
    real = Encoder._render
    monkeypatch.setattr(Encoder, "_render", lambda self, *a, **k: renders.append(1) or real(self, *a, **k))
    got = cut.encode_batch(recs)
    for g, w, r in zip(got, want, recs, strict=True):
        assert g.input_ids[:L].tolist() == w.input_ids[:L].tolist(), r
        assert g.labels[:L].tolist() == w.labels[:L].tolist(), r
        assert (len(g.input_ids) > L) == (len(w.input_ids) > L)
    assert len(want[3].input_ids) > 4 * cut.max_chars  # 120 turns: far past the budget
    assert seen.longest == cut.max_chars  # the tokenizer saw the budget, not the conversation
    if train_on == "completion":  # the layout probe or the prefix renders: up to the budget, not every turn
        assert cut.prefix_renders == whole.prefix_renders == (3 if tools else 0)  # those with tool calls
        renders.clear()
        assert cut.encode_batch([recs[3]])[0].input_ids.tolist() == got[3].input_ids.tolist()
        assistant_turns = sum(m.role == "assistant" for m in recs[3].messages)  # 180 (tools), 120
        assert len(renders) < 2 * 30 < 2 * assistant_turns, len(renders)  # uncut: 2 a turn, and 1
