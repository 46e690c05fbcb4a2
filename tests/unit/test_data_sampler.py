"""Sample order, micro-batch sampling, collation and the DataLoader (llmft.data.sampler/loader)."""

import itertools

import pytest
import torch

from llmft.data import MicroBatchSampler, collate, count_targets, make_loader
from llmft.data.sampler import GlobalOrder
from llmft.data.tokens import TokenDataset
from llmft.plan.batch import BatchPlan

G = 8
LAYOUTS = [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)]  # (micro, acc, dp)


def test_global_order_is_a_seeded_permutation_per_epoch():
    n = 10
    order = GlobalOrder(n, seed=3, shuffle=True)
    epochs = [[order.index(p) for p in range(e * n, (e + 1) * n)] for e in range(3)]
    for perm in epochs:
        assert sorted(perm) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    again = GlobalOrder(n, seed=3, shuffle=True)
    assert [again.index(p) for p in reversed(range(3 * n))] == [i for e in reversed(epochs) for i in reversed(e)]
    assert [GlobalOrder(n, 4, True).index(p) for p in range(n)] != epochs[0]
    assert [order.epoch(p) for p in (0, 9, 10, 29)] == [0, 0, 1, 2]


def test_global_order_without_shuffle_is_file_order():
    order = GlobalOrder(4, seed=0, shuffle=False)
    assert [order.index(p) for p in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def step_batches(order, micro, acc, dp, steps, start=0) -> list[list[list[int]]]:
    """For each step, the micro-batches of all ranks, rank-major."""
    per_rank = [
        list(MicroBatchSampler(order, BatchPlan(G, micro, acc, dp), rank, start_position=start, num_steps=steps))
        for rank in range(dp)
    ]
    return [[b for rank in range(dp) for b in per_rank[rank][s * acc : (s + 1) * acc]] for s in range(steps)]


@pytest.mark.parametrize("micro, acc, dp", LAYOUTS)
def test_a_step_holds_the_same_samples_for_every_layout(micro, acc, dp):
    order = GlobalOrder(13, seed=0, shuffle=True)  # 13: steps straddle epoch ends
    for s, batches in enumerate(step_batches(order, micro, acc, dp, steps=5)):
        assert all(len(b) == micro for b in batches)
        flat = [i for b in batches for i in b]
        # rank-major, micro-minor concatenation is exactly the step's slice of the global order
        assert flat == [order.index(p) for p in range(s * G, (s + 1) * G)]


@pytest.mark.parametrize("micro, acc, dp", LAYOUTS)
def test_resume_from_a_position_continues_exactly(micro, acc, dp):
    order = GlobalOrder(13, seed=1, shuffle=True)
    straight = step_batches(order, micro, acc, dp, steps=6)
    sampler = MicroBatchSampler(order, BatchPlan(G, micro, acc, dp), 0)
    resumed = step_batches(order, micro, acc, dp, steps=4, start=sampler.position_after(2))
    assert resumed == straight[2:]
    # resuming on another layout: the same samples per step
    other = step_batches(order, 1, 8, 1, steps=4, start=sampler.position_after(2))
    assert [sorted(sum(s, [])) for s in other] == [sorted(sum(s, [])) for s in straight[2:]]


def test_sampler_takes_the_batch_plan_and_checks_the_rank():
    plan = BatchPlan(8, 2, 2, 2)  # the plan asserts the batch equation; the sampler does not repeat it
    sampler = MicroBatchSampler(GlobalOrder(16, 0, False), plan, 1, num_steps=2)
    assert list(sampler) == [[4, 5], [6, 7], [12, 13], [14, 15]]
    assert len(sampler) == 4 and sampler.position_after(2) == 16
    with pytest.raises(ValueError, match=r"dp_rank 2 is not in \[0, 2\)"):
        MicroBatchSampler(GlobalOrder(4, 0, False), plan, 2)


def test_collate_unpacked_pads_right_with_attention_mask():
    rows = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": None},
        {"input_ids": [8], "labels": [8], "position_ids": None},
    ]
    b = collate(rows, pad_id=0)
    assert b.keys() == {"input_ids", "labels", "attention_mask"}
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert count_targets(b["labels"]) == 2  # labels[:, 0] is never predicted


def test_collate_packed_has_positions_and_no_attention_mask():
    rows = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, -100, 4], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [5, 6], "labels": [-100, 6], "position_ids": [0, 1]},
    ]
    b = collate(rows, pad_id=9)
    assert b.keys() == {"input_ids", "labels", "position_ids", "token_mask"}
    assert b["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert b["token_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]  # the padded tail: for counting, not the model
    assert b["input_ids"][1].tolist() == [5, 6, 9, 9] and b["labels"][1].tolist() == [-100, 6, -100, -100]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_yields_the_sampler_batches(num_workers):
    ds = TokenDataset([([i] * (1 + i % 3), [i] * (1 + i % 3), None) for i in range(6)])
    order = GlobalOrder(len(ds), seed=0, shuffle=True)
    sampler = MicroBatchSampler(order, BatchPlan(4, 2, 2, 1), 0, num_steps=3)
    loader = make_loader(ds, sampler, pad_id=0, num_workers=num_workers, prefetch_factor=2)
    got = list(itertools.islice(loader, 6))
    for batch, idx in zip(got, sampler, strict=True):
        want = collate([ds[i] for i in idx], 0)
        assert all(torch.equal(batch[k], want[k]) for k in want)
