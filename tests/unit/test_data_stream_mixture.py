"""data.streaming with several sources (data.mixture: probability): each source's exact share of every
window as for cached mixtures, the order a pure function of (seed, position), one cursor per source in
the checkpoint and a bit-exact resume from it (docs/data.md, streaming)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import metrics, train_inproc, write_data, write_recipe

from llmft.checkpoint.layout import TrainerState
from llmft.data import build_data
from llmft.data.sampler import ProbabilityOrder
from llmft.data.stream import MixedStream
from llmft.data.tokenizer import load_tokenizer
from llmft.errors import UserError
from llmft.recipe import load_recipe


def _recipe(root: Path, **over) -> Path:
    write_data(root / "a.jsonl", n=30, seed=1)
    write_data(root / "b.jsonl", n=12, seed=2, kind="text")
    sources = [{"path": str(root / "a.jsonl"), "weight": 3}, {"path": str(root / "b.jsonl"), "weight": 1}]
    over.setdefault("data__mixture", "probability")
    return write_recipe(root, data__train=sources, data__cache_dir=str(root / "cache"), **over)


def _bundle(root: Path, **over):
    recipe = load_recipe(str(_recipe(root, **over)), [])
    return build_data(recipe, load_tokenizer(recipe.model))


def _rows(ds, positions) -> list[tuple]:
    return [(tuple(ds[p]["input_ids"]), tuple(ds[p]["labels"])) for p in positions]


def test_streamed_mixture_takes_the_cached_mixtures_rows_in_its_order(tmp_path):
    """Unshuffled and unpacked, a source's stream is its rows in file order pass after pass, which is
    what the cached probability mixture takes too: the same windows deal the same rows."""
    common = dict(data__shuffle=False, data__stream_block=4)
    cached = _bundle(tmp_path, **common)
    stream = _bundle(tmp_path, data__streaming=True, **common).train
    assert isinstance(stream, MixedStream)
    order = cached.order(0, False)
    positions = range(300)  # source b (12 rows) passes ~6 times, source a (30 rows) ~7 times
    assert _rows(stream, positions) == _rows(cached.train, [order.index(p) for p in positions])
    assert stream.windows.taken(ProbabilityOrder.WINDOW) == [7500, 2500]
    drawn = [stream.windows.draw(p)[0] for p in range(ProbabilityOrder.WINDOW + 300)]
    for at in (0, 1, 299, ProbabilityOrder.WINDOW + 300):
        assert stream.windows.taken(at) == [drawn[:at].count(0), drawn[:at].count(1)]


def test_streamed_mixture_is_a_pure_function_of_seed_and_position_and_resumes_from_its_cursors(tmp_path):
    over = dict(data__streaming=True, data__shuffle=True, data__packing=True, data__stream_block=5)
    straight = _bundle(tmp_path, **over).train
    want = _rows(straight, range(240))
    assert want != _rows(_bundle(tmp_path, **{**over, "data__shuffle": False}).train, range(240))
    assert want != _rows(_bundle(tmp_path, **{**over, "run__seed": 1}).train, range(240))
    for at in (0, 1, 2, 37, 161, 239):
        cursors = json.loads(json.dumps(straight.cursor_at(at)))  # as the checkpoint stores them
        assert len(cursors) == 2 and [c["row"] for c in cursors] <= straight.windows.taken(at)
        resumed = _bundle(tmp_path, **over).train
        resumed.restore(cursors)
        assert _rows(resumed, range(at, 240)) == want[at:]
        # Neither source is re-read before its cursor: at most one block of each before `at` again.
        for s, c, n in zip(resumed.streams, cursors, straight.windows.taken(240), strict=True):
            assert s.stats["records"] <= (n - c["row"]) * 5 + 5


def test_streamed_mixture_stop_and_resume_is_bit_exact(tmp_path):
    over = dict(
        data__streaming=True, data__shuffle=True, data__packing=True, data__stream_block=6,
        batch__global_batch_size=4, batch__micro_batch_size=2, peft__method="lora", peft__dropout=0.1, peft__r=4,
    )  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train_inproc(_recipe(ref, train__max_steps=8, **over)) == 0
    assert train_inproc(_recipe(run, train__max_steps=5, checkpoint__every_steps=5, **over)) == 0
    state = TrainerState.read(run / "run/checkpoints/step-5")
    assert state.samples == 20 and len(state.data["stream"]) == 2
    assert sum(c["row"] for c in state.data["stream"]) <= 20 and state.data["stream"][0]["block"] > 0
    assert train_inproc(_recipe(run, train__max_steps=8, **over)) == 0  # resumes from step-5
    rows, ref_rows = metrics(run / "run"), metrics(ref / "run")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in ref_rows]


def test_streamed_mixture_refuses_repeat_weights_and_a_cursor_of_other_sources(tmp_path):
    with pytest.raises(UserError) as e:
        _bundle(tmp_path, data__streaming=True, data__mixture="repeat")
    assert [p.where for p in e.value.problems] == ["data.mixture"]
    assert "Set data.mixture=probability (each weight a share of the samples)" in str(e.value)
    data = _bundle(tmp_path, data__streaming=True)
    single = {"pass": 0, "block": 1, "row": 3, "source": {"file": 0, "byte": 10, "line": 1}}
    with pytest.raises(UserError) as e:
        data.restore({"stream": single})
    assert str(e.value) == (
        "data.train: streams 2 source(s), but the checkpoint's stream cursor is for 1. Resume with the "
        "data.train the checkpoint was trained on, or set checkpoint.resume=never."
    )
