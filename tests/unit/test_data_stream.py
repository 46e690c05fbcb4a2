"""data.streaming: the same rows as the cache, order a pure function of (seed, position), exact resume
from a cursor, and the ranks' shares of each global batch (docs/data.md, streaming)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import metrics, train_inproc, write_data, write_recipe

from llmft.checkpoint.layout import TrainerState
from llmft.data import MicroBatchSampler, build_data
from llmft.data.sampler import Positions as StreamOrder
from llmft.data.tokenizer import load_tokenizer
from llmft.errors import UserError
from llmft.plan.batch import BatchPlan
from llmft.recipe import load_recipe


def _bundle(tmp_path: Path, **over):
    recipe = load_recipe(str(write_recipe(tmp_path, data__cache_dir=str(tmp_path / "cache"), **over)), [])
    return build_data(recipe, load_tokenizer(recipe.model))


def _rows(ds, positions) -> list[tuple]:
    return [(tuple(ds[p]["input_ids"]), tuple(ds[p]["labels"])) for p in positions]


@pytest.mark.parametrize("packing", [False, True])
def test_streamed_rows_are_the_cached_rows_in_order(tmp_path, packing):
    write_data(tmp_path / "train.jsonl", n=30)
    # Packing best-fits within a block, so the rows match the cache's when one block holds the data.
    block = 100 if packing else 4
    common = dict(data__shuffle=False, data__packing=packing, data__stream_block=block)
    cached = _bundle(tmp_path, **common).train
    stream = _bundle(tmp_path, data__streaming=True, **common).train
    n = len(cached)
    assert _rows(stream, range(3 * n)) == _rows(cached, [p % n for p in range(3 * n)])  # three passes


def test_order_is_a_pure_function_of_seed_and_position_and_resumes_from_a_cursor(tmp_path):
    write_data(tmp_path / "train.jsonl", n=50)
    over = dict(data__streaming=True, data__shuffle=True, data__stream_block=7, data__packing=True)
    straight = _bundle(tmp_path, **over).train
    want = _rows(straight, range(200))
    assert want != _rows(_bundle(tmp_path, **{**over, "data__shuffle": False}).train, range(200))
    for at in (0, 1, 13, 61, 150):
        resumed = _bundle(tmp_path, **over).train
        cursor = json.loads(json.dumps(straight.cursor_at(at)))  # as the checkpoint stores it
        resumed.restore(cursor)
        assert _rows(resumed, range(at, 200)) == want[at:]
        # No re-reading of the stream before the cursor: at most one block before `at` is tokenized.
        assert resumed.stats["records"] <= (200 - cursor["row"]) * 7 + 7
    mid = straight.cursor_at(61)
    assert mid["source"]["byte"] > 0 and mid["row"] <= 61  # JSONL: a byte offset to seek to


def test_parquet_stream_resumes_from_the_datasets_state(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in write_data(tmp_path / "src.jsonl", n=40).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=8)
    over = dict(data__train=str(tmp_path / "train.parquet"), data__streaming=True, data__stream_block=6)
    straight = _bundle(tmp_path, **over).train
    want = _rows(straight, range(100))
    resumed = _bundle(tmp_path, **over).train
    resumed.restore(json.loads(json.dumps(straight.cursor_at(57))))
    assert _rows(resumed, range(57, 100)) == want[57:]


def test_two_ranks_take_disjoint_shares_covering_each_global_batch(tmp_path):
    """Each rank reads its own copy of the stream and takes its MicroBatchSampler slice (G1)."""
    write_data(tmp_path / "train.jsonl", n=40)
    over = dict(data__streaming=True, data__shuffle=True, data__stream_block=5)

    def taken(rank: int, dp: int, acc: int) -> list[list[int]]:
        ds = _bundle(tmp_path, **over).train
        sampler = MicroBatchSampler(StreamOrder(), BatchPlan(8, 8 // dp // acc, acc, dp), rank, num_steps=6)
        return [positions for positions in sampler], ds

    one, ds1 = taken(0, 1, 1)
    (r0, ds_a), (r1, ds_b) = taken(0, 2, 2), taken(1, 2, 2)
    for step in range(6):
        share0 = r0[2 * step] + r0[2 * step + 1]
        share1 = r1[2 * step] + r1[2 * step + 1]
        assert not set(share0) & set(share1)
        assert sorted(share0 + share1) == sorted(one[step])
        assert _rows(ds_a, share0) + _rows(ds_b, share1) == _rows(ds1, one[step])


def test_streamed_run_has_the_cached_runs_losses(tmp_path):
    losses = {}
    for name, streaming in (("cached", False), ("stream", True)):
        d = tmp_path / name
        write_data(d / "train.jsonl", n=20)
        recipe = write_recipe(
            d, data__shuffle=False, data__streaming=streaming, data__stream_block=3,
            data__cache_dir=str(tmp_path / "cache"), train__max_steps=6,
        )  # fmt: skip
        assert train_inproc(recipe) == 0
        losses[name] = [r["loss"] for r in metrics(d / "run")]
    assert losses["stream"] == losses["cached"]  # 20 rows, 48 taken: across two epoch boundaries


def test_streamed_stop_and_resume_is_bit_exact(tmp_path):
    over = dict(
        data__streaming=True, data__shuffle=True, data__packing=True, data__stream_block=6,
        batch__global_batch_size=4, batch__micro_batch_size=2, peft__method="lora", peft__dropout=0.1, peft__r=4,
    )  # fmt: skip
    ref = tmp_path / "ref"
    write_data(ref / "train.jsonl", n=40)
    assert train_inproc(write_recipe(ref, train__max_steps=8, **over)) == 0
    run = tmp_path / "run"
    write_data(run / "train.jsonl", n=40)
    assert train_inproc(write_recipe(run, train__max_steps=5, checkpoint__every_steps=5, **over)) == 0
    state = TrainerState.read(run / "run/checkpoints/step-5")
    assert state.samples == 20 and state.data["stream"]["row"] <= 20 and state.data["stream"]["block"] > 0
    assert train_inproc(write_recipe(run, train__max_steps=8, **over)) == 0
    assert [r["loss"] for r in metrics(run / "run")] == [r["loss"] for r in metrics(ref / "run")]
    assert [r["grad_norm"] for r in metrics(run / "run")] == [r["grad_norm"] for r in metrics(ref / "run")]


def test_streaming_refuses_what_it_cannot_do(tmp_path):
    write_data(tmp_path / "train.jsonl", n=10)
    with pytest.raises(UserError) as e:
        _bundle(
            tmp_path, data__streaming=True, data__eval_fraction=0.1, train__max_steps=None, train__epochs=1,
            data__train=[str(tmp_path / "train.jsonl")] * 2,
        )  # fmt: skip
    assert [p.where for p in e.value.problems] == ["data.mixture", "train.max_steps", "data.eval_fraction"]
    assert "cannot hold out a fraction of records it has not read" in str(e.value)


def test_a_streamed_bad_record_names_file_and_line_with_a_suggestion(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"promt": "p", "completion": "c"}) + "\n")
    ds = _bundle(tmp_path, data__streaming=True).train
    with pytest.raises(UserError) as e:
        ds[0]
    assert str(e.value) == (
        f"{path}:2: has 'completion' but no 'prompt' (did you mean 'prompt' for 'promt'). "
        "Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
    )
