"""Rows of a million tokens: a row costs bytes, not Python objects, from the
tokenizer's output through the cache and the packed row to the collated tensors (docs/data.md,
"Long rows").

The tokenizer here is a word-level fast tokenizer whose ids are >= 256: CPython keeps one shared
object for each int up to 256, so a list of byte-tokenizer ids would cost 8 bytes a token and no
new objects, and a per-token list would go unseen. With these ids, a list of a row's tokens is a
million int objects, which ``sys.getallocatedblocks`` counts and tracemalloc weighs (~40 bytes a
token).
"""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import data_recipe

from llmft.data import build_data, collate
from llmft.data.encode import IGNORE_INDEX
from llmft.data.kinds.pairs import collate_pairs
from llmft.data.pack import positions
from llmft.model.kernels import varlen_kwargs

WORDS = [a + b + c for a in "abcdefgh" for b in "abcdefgh" for c in "abcdefgh"]  # ids 4 .. 515
MILLION = 1 << 20


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3} | {w: 4 + i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def words(n: int, seed: int) -> tuple[str, np.ndarray]:
    """A text of ``n`` words and its token ids (without bos and eos)."""
    idx = np.random.default_rng(seed).integers(0, len(WORDS), n)
    return " ".join(np.asarray(WORDS)[idx].tolist()), (idx + 4).astype(np.int32)


@dataclass
class Cost:
    blocks: int  # Python objects (pymalloc blocks) still held after the step, less those before it
    peak: int  # bytes traced at the step's peak (Python objects and numpy buffers), less those before


def measure(step):
    """``step()`` and what it cost: the objects its result holds, and its peak traced bytes."""
    gc.collect()
    before = sys.getallocatedblocks()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out = step()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    gc.collect()
    return out, Cost(sys.getallocatedblocks() - before, peak)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% if m['role'] == 'assistant' %}<eos> {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def one_record(tmp_path: Path, kind: str, n: int) -> tuple:
    """A data file of one record of ``kind`` that tokenizes to about ``n`` tokens, its recipe, and the
    ids its row holds (text records) or None."""
    text, ids = words(n - 2, seed=n)  # bos + words + eos
    prompt = "abc abd abe"
    half = " ".join(text.split(" ")[: n // 2])
    record = {
        "text": {"text": text},
        "packed": {"text": text},
        "completion": {"prompt": prompt, "completion": text},
        "chat": {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]},
        "pair": {"prompt": prompt, "chosen": half, "rejected": half[::-1].replace(" ", "a", 1)[::-1]},
    }[kind]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"long-{n}.jsonl"
    path.write_text(json.dumps(record) + "\n")
    recipe = data_recipe(tmp_path, str(path), max_seq_len=MILLION, num_proc=1, packing=kind == "packed")
    if kind == "pair":
        recipe.train.objective = "dpo"
    return recipe, np.concatenate([[1], ids, [2]]) if kind in ("text", "packed") else None


# What reading a row and building its cache entry may cost per token, in traced bytes: a row's
# labels are 4 bytes a token (5 at the peak, with the target mask), a packed row's position ids 8;
# a build holds the tokenizer's own Python list of one call's ids (~40 bytes a token) or, for chat
# masking, its offsets too (a tuple a token), besides the cache's arrays.
READ = {"text": 6, "packed": 6 + 8, "completion": 6, "chat": 6, "pair": 6}
BUILD = {"text": 80, "packed": 80, "completion": 80, "chat": 300, "pair": 80}


@pytest.mark.slow  # tokenizes and caches 1M tokens three times per kind: ~15-40 s each on 2 cores
@pytest.mark.parametrize("kind", ["text", "packed", "completion", "chat", "pair"])
def test_a_million_token_row_costs_bytes_not_objects(tmp_path, kind):
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    costs = {}
    for n in (10_000, MILLION - 8, 10_000):  # the small one twice: the first run pays for imports
        recipe, want = one_record(tmp_path / f"{n}-{len(costs)}", kind, n)
        bundle, build = measure(lambda recipe=recipe: build_data(recipe, tok))
        item, read = measure(lambda bundle=bundle: bundle.train[0])
        batch, coll = measure(lambda item=item: collate([item], tok.pad_token_id))
        tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        assert n - 20 <= tokens <= n + 10, (kind, n, tokens)  # the targets: the record, less its prompt
        if want is not None:
            assert torch.equal(batch["input_ids"][0, :n], torch.from_numpy(want.astype(np.int64)))
            # every token a target (but a packed row's first, never predicted from the previous record)
            assert torch.equal(batch["labels"][0, 1:n], batch["input_ids"][0, 1:n])
        if kind == "packed":  # one record in a row of MILLION: the record, then the padded tail
            assert batch["input_ids"].shape == (1, MILLION) and batch["position_ids"].dtype == torch.int64
            assert torch.equal(batch["position_ids"][0], torch.cat([torch.arange(n), torch.arange(MILLION - n)]))
        costs[n] = (build, read, coll)
        del bundle, item, batch
    small, large = costs[10_000], costs[MILLION - 8]
    extra = MILLION - 8 - 10_000
    for stage, a, b in zip(("build", "read", "collate"), small, large, strict=True):
        # No object per token: the objects the result holds do not grow with the row (a list of the
        # ids alone would add ~1M).
        assert abs(b.blocks - a.blocks) < 200, (stage, a, b)
    build, read, coll = (b.peak - a.peak for a, b in zip(small, large, strict=True))
    if kind == "packed":  # both rows are MILLION long: the small record's row costs the same
        assert read <= READ[kind] * MILLION, read
    else:
        assert read <= READ[kind] * extra, read
    # Collating: the int64 tensors are torch's (untraced); nothing per token on the Python side.
    assert coll <= extra // 100, coll
    assert build <= BUILD[kind] * extra, build


@pytest.mark.slow  # builds a cache of 3M tokens: ~20 s on 2 cores
def test_documents_pack_into_million_token_rows_with_their_boundaries(tmp_path):
    """Many documents best-fit into rows of 2^20 tokens: each row's position ids restart at every
    document, the varlen boundaries (cu_seqlens, int32) are the documents', each document's tokens
    and targets are whole, and a document longer than a row is truncated to one row."""
    tok = word_tokenizer()
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1_000, 120_000, 40)] + [MILLION + 500]
    docs = [words(n, seed=k) for k, n in enumerate(lengths)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text, _ in docs))
    bundle = build_data(data_recipe(tmp_path, str(path), max_seq_len=MILLION, packing=True, num_proc=1), tok)
    assert bundle.stats["truncated"] == 1
    wanted = {ids[:50].tobytes(): np.concatenate([[1], ids, [2]])[:MILLION] for _, ids in docs}
    seen = 0
    for r in range(len(bundle.train)):
        row = bundle.train[r]
        batch = collate([row], tok.pad_token_id)
        pos = batch["position_ids"]
        assert pos.shape == (1, MILLION) and pos.dtype == torch.int64
        cu = varlen_kwargs(pos)["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and int(cu[-1]) == MILLION
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            assert torch.equal(pos[0, a:b], torch.arange(b - a))
            ids = batch["input_ids"][0, a:b].numpy()
            if (ids == tok.pad_token_id).all():  # the padded tail
                assert (batch["labels"][0, a:b] == IGNORE_INDEX).all()
                continue
            want = wanted.pop(ids[1:51].astype(np.int32).tobytes())
            assert np.array_equal(ids, want)
            labels = batch["labels"][0, a:b].numpy()
            assert labels[0] == IGNORE_INDEX and np.array_equal(labels[1:], ids[1:])
            seen += 1
    assert seen == len(docs) and not wanted


def test_position_ids_restart_at_every_segment_and_reach_a_million():
    segs = np.array([3, 1, MILLION, 2], dtype=np.int32)
    pos = positions(segs)
    assert pos.dtype == np.int64 and len(pos) == MILLION + 6
    assert pos[:6].tolist() == [0, 1, 2, 0, 0, 1] and pos[MILLION + 3] == MILLION - 1
    assert pos[-2:].tolist() == [0, 1]
    assert positions(np.zeros(0, np.int32)).tolist() == []


def test_varlen_boundaries_of_a_million_token_row_are_int32():
    pos = torch.from_numpy(positions(np.array([MILLION - 5, 5])))[None]
    kw = varlen_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, MILLION - 5, MILLION] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["max_length_q"] == MILLION - 5


def test_padding_free_pairs_of_long_sequences_collate_as_arrays():
    """A preference micro-batch of two pairs of ~250K-token sequences: one row of ~1M tokens, built
    from the items' arrays with no object per token."""
    rng = np.random.default_rng(0)
    lengths = [250_000, 249_000, 240_000, 260_001]
    seqs = [rng.integers(300, 500, n).astype(np.int32) for n in lengths]
    items = [
        {
            side: {"input_ids": s, "labels": s, "position_ids": np.arange(len(s), dtype=np.int64)}
            for side, s in zip(("chosen", "rejected"), pair, strict=True)
        }
        for pair in (seqs[:2], seqs[2:])
    ]
    batch, cost = measure(lambda: collate_pairs(items, 0))
    total = sum(lengths)
    assert batch["input_ids"].shape == (1, total) and batch["position_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][0], torch.from_numpy(np.concatenate(seqs).astype(np.int64)))
    starts = np.cumsum([0, *lengths])
    assert varlen_kwargs(batch["position_ids"])["cu_seq_lens_q"].tolist() == starts.tolist()
    for k in range(4):
        assert (batch["sequence_index"][0, starts[k] : starts[k + 1]] == k).all()
    assert cost.blocks < 100  # a handful of tensors, not a million ints


def test_token_blocks_cut_by_tokens_so_one_long_record_leaves_the_short_ones_in_large_blocks():
    from llmft.data.pack import token_blocks

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 90, 20_000)
    lengths[7] = MILLION
    blocks = token_blocks(lengths, 1 << 16)
    assert [lo for lo, _ in blocks] == [0] + [hi for _, hi in blocks[:-1]] and blocks[-1][1] == len(lengths)
    for lo, hi in blocks:
        assert hi > lo and (lengths[lo:hi].sum() <= 2 << 16 or hi - lo == 1 or lengths[lo:hi].max() == MILLION)
    assert len(blocks) < 2 * lengths.sum() / (1 << 16) + 2  # not ~20,000 / (2^16 / 2^20) blocks of one record
    assert token_blocks(np.zeros(0, np.int64), 8) == []


def test_eval_prompts_are_views_of_the_cache_not_lists(tmp_path):
    tok = word_tokenizer()
    prompt, ids = words(200_000, seed=3)
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"text": "abc abd"}) + "\n")
    ev = tmp_path / "e.jsonl"
    ev.write_text(json.dumps({"prompt": prompt, "completion": "abc"}) + "\n")
    recipe = data_recipe(tmp_path, str(train), max_seq_len=MILLION, num_proc=1)
    recipe.data.eval = str(ev)
    ((got, reference),) = build_data(recipe, tok).eval_prompts
    assert isinstance(got, np.ndarray) and not got.flags.writeable  # a view of the mapped prompts.arrow
    assert np.array_equal(got, np.concatenate([[1], ids])) and reference == "abc"
