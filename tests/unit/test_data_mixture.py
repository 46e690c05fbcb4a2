"""Mixtures: ``data.mixture: probability`` gives each source its exact share of every window, the
order is a pure function of (seed, position), and a mixture run stops and resumes bit for bit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers import metrics, train_inproc, write_data, write_recipe

from llmft.data import build_data
from llmft.data.sampler import ProbabilityOrder, largest_remainder
from llmft.data.tokenizer import load_tokenizer
from llmft.errors import UserError
from llmft.recipe import load_recipe

W = ProbabilityOrder.WINDOW


def test_each_window_holds_each_source_exactly_its_share():
    lengths = [50, 30, 7]
    order = ProbabilityOrder(lengths, [0.7, 0.2, 0.1], seed=3, shuffle=True)
    for window in range(3):
        got = Counter(order.source(p) for p in range(window * W, (window + 1) * W))
        assert got == {0: 7000, 1: 2000, 2: 1000}
    # within a source, its rows come once per its own epoch, in its own seeded order
    picks = [order.index(p) for p in range(3 * W) if order.source(p) == 2]
    for epoch in range(len(picks) // 7):
        assert sorted(picks[7 * epoch : 7 * epoch + 7]) == list(range(80, 87))
    assert picks[:7] != picks[7:14]  # reshuffled every epoch of the source
    assert largest_remainder([1, 1, 1], W) == [3334, 3333, 3333]


def test_the_order_is_a_pure_function_of_seed_and_position():
    make = lambda seed: ProbabilityOrder([40, 9], [3, 1], seed, shuffle=True)  # noqa: E731
    once = make(0)
    straight = [once.index(p) for p in range(25_000)]
    for at in (0, 9_999, 10_000, 17_321):
        fresh = make(0)
        assert [fresh.index(p) for p in range(at, 25_000)] == straight[at:]
    other = make(1)
    assert [other.index(p) for p in range(100)] != straight[:100]


def _recipe(root: Path, **over) -> Path:
    write_data(root / "a.jsonl", n=30, seed=1)
    write_data(root / "b.jsonl", n=12, seed=2, kind="text")
    sources = [{"path": str(root / "a.jsonl"), "weight": 3}, {"path": str(root / "b.jsonl"), "weight": 1}]
    return write_recipe(root, data__train=sources, data__cache_dir=str(root.parent / "cache"), **over)


def test_probability_weights_through_build_data(tmp_path):
    recipe = load_recipe(str(_recipe(tmp_path, data__mixture="probability")), [])
    data = build_data(recipe, load_tokenizer(recipe.model))
    assert data.probabilities == [0.75, 0.25] and data.num_rows == 42
    order = data.order(0, True)
    assert Counter(order.index(p) < 30 for p in range(2 * W)) == {True: 15000, False: 5000}


def test_a_weight_below_one_sample_per_window_is_refused(tmp_path):
    write_data(tmp_path / "a.jsonl", n=5)
    sources = [str(tmp_path / "a.jsonl"), {"path": str(tmp_path / "a.jsonl"), "weight": 1e-5}]
    recipe = load_recipe(str(write_recipe(tmp_path, data__train=sources, data__mixture="probability")), [])
    with pytest.raises(UserError) as e:
        build_data(recipe, load_tokenizer(recipe.model))
    assert str(e.value.problems[0]) == str(e.value).splitlines()[0]
    assert e.value.problems[0].where == "data.train[1].weight"
    assert "is less than one sample in 10,000" in e.value.problems[0].what


@pytest.mark.parametrize("mixture", ["repeat", "probability"])
def test_mixture_run_stops_and_resumes_bit_exact_from_the_cache(tmp_path, mixture):
    over = dict(
        data__mixture=mixture, data__shuffle=True, data__packing=True, batch__global_batch_size=4,
        batch__micro_batch_size=2, peft__method="lora", peft__dropout=0.1, peft__r=4,
    )  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train_inproc(_recipe(ref, train__max_steps=9, **over)) == 0
    assert train_inproc(_recipe(run, train__max_steps=4, checkpoint__every_steps=4, **over)) == 0
    assert train_inproc(_recipe(run, train__max_steps=9, **over)) == 0  # resumes from step-4
    rows, ref_rows = metrics(run / "run"), metrics(ref / "run")
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in ref_rows]
