"""Packing: row invariants, and proof on a tiny Llama that packed rows give the unpacked loss."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama_model

from llmft.data import build_data, collate, count_targets
from llmft.data.encode import IGNORE_INDEX, Example
from llmft.data.pack import pack, plan_rows
from llmft.data.tokenizer import byte_tokenizer
from llmft.data.tokens import TokenDataset
from llmft.recipe.schema import Recipe

PAD = 256


def test_best_fit_in_order():
    # 5 -> new row 0 (3 left); 3 fills row 0; 4 -> new row 1 (4 left); 2 -> row 1; 6 -> new row 2
    assert plan_rows([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    # best fit, not first fit: 2 goes to the row with 2 left, not the older one with 3 left
    assert plan_rows([5, 6, 2], 8) == [[0], [1, 2]]
    # equal space: the oldest row
    assert plan_rows([6, 6, 2], 8) == [[0, 2], [1]]


def best_fit_by_definition(lengths: list[int], capacity: int) -> list[list[int]]:
    """Each example to the open row with the least space that holds it, ties to the oldest, else a new row."""
    rows, space = [], []
    for i, n in enumerate(lengths):
        fits = [(space[r], r) for r in range(len(rows)) if space[r] >= n]
        if fits:
            _, r = min(fits)
            rows[r].append(i)
            space[r] -= n
        else:
            rows.append([i])
            space.append(capacity - n)
    return rows


@pytest.mark.parametrize("capacity", [1, 7, 64, 300])
def test_bucketed_best_fit_is_the_definition(capacity):
    rng = np.random.default_rng(capacity)
    for _ in range(20):
        lengths = rng.integers(1, capacity + 1, size=int(rng.integers(0, 200))).tolist()
        assert plan_rows(lengths, capacity) == best_fit_by_definition(lengths, capacity)


def test_packing_a_block_of_tokens_at_a_time_gives_the_same_rows():
    from llmft.data.pack import pack_arrays

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 17, 300)
    starts = np.cumsum(lengths) - lengths
    ids = rng.integers(0, 256, int(lengths.sum())).astype(np.int32)
    target = rng.integers(0, 2, len(ids)).astype(np.uint8)
    whole = pack_arrays(ids, target, starts, lengths, 16, PAD, block_tokens=1 << 30)
    for block in (1, 16, 50, 1000):
        part = pack_arrays(ids, target, starts, lengths, 16, PAD, block_tokens=block)
        for name in ("input_ids", "target", "segments", "segment_offsets"):
            assert np.array_equal(getattr(part, name), getattr(whole, name)), (block, name)


def test_packed_rows_keep_every_token_and_never_cross_a_boundary(tmp_path):
    tok = byte_tokenizer()
    records = [{"prompt": "p" * (i % 5), "completion": "c" * (1 + i * 7 % 11)} for i in range(30)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = Recipe()
    r.data.train, r.data.max_seq_len = str(path), 24
    plain = build_data(r, tok)
    r.data.packing = True
    packed = build_data(r, tok)

    assert len(packed.train) < len(plain.train) == 30
    assert packed.stats["target_tokens"] == plain.stats["target_tokens"]
    pieces = []
    for i in range(len(packed.train)):
        row = packed.train[i]
        ids, labels, pos = (row[k].tolist() for k in ("input_ids", "labels", "position_ids"))
        assert len(ids) == len(labels) == len(pos) == 24
        starts = [t for t, p in enumerate(pos) if p == 0] + [24]
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b] == list(range(b - a))
            assert labels[a] == IGNORE_INDEX  # would be predicted from the previous sequence
            pieces.append((ids[a:b], labels[a + 1 : b]))
    # every unpacked example appears exactly once (plus pad-only tail pieces), labels unchanged
    expected = sorted((plain.train[i]["input_ids"].tolist(), plain.train[i]["labels"][1:].tolist()) for i in range(30))
    real = sorted(p for p in pieces if set(p[0]) != {tok.pad_token_id})
    assert real == expected


def examples() -> list[Example]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for n, masked in [(5, 2), (9, 0), (3, 1), (7, 4), (12, 3), (4, 0)]:
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        out.append(Example(ids, [IGNORE_INDEX] * masked + ids[masked:]))
    return out


def token_losses(model, batch: dict, use_cache: bool | None = False) -> torch.Tensor:
    """The loss of every target token (HF's shift: logits at t predict labels at t + 1)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=use_cache).logits
    labels = batch["labels"][:, 1:].flatten()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return losses[labels != IGNORE_INDEX]


def summed_loss(model, batch: dict, use_cache: bool | None = False) -> float:
    return float(token_losses(model, batch, use_cache).sum())


def batches(restart_positions: bool = True) -> tuple[dict, dict]:
    exs = examples()
    packed_rows = pack(exs, 16, PAD)
    assert len(packed_rows) < len(exs)  # several sequences share a row
    dataset = TokenDataset(packed_rows)
    packed = collate([dataset[i] for i in range(len(dataset))], PAD)
    if not restart_positions:
        packed["position_ids"] = torch.arange(16).expand_as(packed["input_ids"]).clone()
    plain = collate([{"input_ids": e.input_ids, "labels": e.labels, "position_ids": None} for e in exs], PAD)
    return packed, plain


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_loss(attn):
    model = tiny_llama_model(attn, num_key_value_heads=4, max_position_embeddings=64)
    packed, plain = batches()
    assert "attention_mask" not in packed and "attention_mask" in plain
    assert count_targets(packed["labels"]) == count_targets(plain["labels"])
    # token by token (as multisets: packing reorders them) to 1e-5, and the sums to fp32 precision
    want, got = token_losses(model, plain), token_losses(model, packed)
    assert len(want) == len(got) == count_targets(plain["labels"])
    assert torch.allclose(want.sort().values, got.sort().values, rtol=0, atol=1e-5)
    assert abs(float(got.sum()) - float(want.sum())) < 1e-6 * float(want.sum())
    # the HF loss with the global target count, as the training loop computes it, agrees too
    n = torch.tensor(float(count_targets(plain["labels"])))
    with torch.no_grad():
        a = model(**plain, num_items_in_batch=n, use_cache=False).loss
        b = model(**packed, num_items_in_batch=n, use_cache=False).loss
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_differs_without_restarted_positions(attn):
    """The proof can fail: with plain 0..L-1 positions, attention leaks across sequences."""
    model = tiny_llama_model(attn, num_key_value_heads=4, max_position_embeddings=64)
    packed, plain = batches(restart_positions=False)
    assert abs(summed_loss(model, packed) - summed_loss(model, plain)) > 1e-2


def test_packed_mask_needs_use_cache_false():
    """transformers behaviour the loop relies on: with a KV cache (config.use_cache defaults to True),
    create_causal_mask skips packed-sequence detection and attention leaks across sequences."""
    model = tiny_llama_model("sdpa", num_key_value_heads=4, max_position_embeddings=64)
    assert model.config.use_cache
    packed, plain = batches()
    assert abs(summed_loss(model, packed, use_cache=None) - summed_loss(model, plain)) > 1e-2
