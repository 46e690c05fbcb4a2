"""A rank's sequence slice (llmft/data/sequence.py) and the whole-row packed mask (llmft/model/ulysses.py)."""

from __future__ import annotations

import pytest
import torch
from preference_batches import collate_pairs, make_pairs

from llmft.data.loader import batch_targets, collate, count_targets
from llmft.data.sequence import sequence_slice
from llmft.model.ulysses import block_causal_mask
from llmft.objectives.reward import sequence_scores, slice_scores


def _batch(packed: bool) -> dict:
    rows = [
        {
            "input_ids": [5, 6, 7, 8, 9],
            "labels": [-100, -100, 7, 8, 9],
            "position_ids": [0, 1, 0, 1, 2] if packed else None,
        },
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": [0, 1, 2] if packed else None},
    ]
    return collate(rows, pad_id=0)


def test_an_odd_row_is_padded_and_each_target_lands_in_exactly_one_slice():
    batch = _batch(packed=False)  # width 5: padded to 6, 3 tokens per rank
    a, b = sequence_slice(batch, 0, 2), sequence_slice(batch, 1, 2)
    assert a["input_ids"].tolist() == [[5, 6, 7], [1, 2, 3]]
    assert b["input_ids"].tolist() == [[8, 9, 0], [0, 0, 0]]
    # Shifted before slicing: token 7 (rank 0's last) keeps its target 8, which rank 1 holds.
    assert a["shift_labels"].tolist() == [[-100, 7, 8], [2, 3, -100]]
    assert b["shift_labels"].tolist() == [[9, -100, -100], [-100, -100, -100]]
    assert a["position_ids"].tolist() == [[0, 1, 2]] * 2 and b["position_ids"].tolist() == [[3, 4, 5]] * 2
    assert "attention_mask" not in a and "labels" not in a
    assert batch_targets(a) + batch_targets(b) == count_targets(batch["labels"]) == 5
    assert batch_targets(b) + 0 == 1  # a slice may hold few or no targets: normal


def test_packed_positions_are_the_whole_rows():
    batch = _batch(packed=True)
    a, b = sequence_slice(batch, 0, 2), sequence_slice(batch, 1, 2)
    assert torch.cat([a["position_ids"], b["position_ids"]], 1).tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2]]


def test_per_token_bookkeeping_is_sliced_and_pair_counts_kept():
    batch = {**_batch(packed=False), "sequence_index": torch.tensor([[0] * 5, [1] * 3 + [-1] * 2]), "num_pairs": 1}
    b = sequence_slice(batch, 1, 2)
    assert b["sequence_index"].tolist() == [[0, 0, -1], [-1, -1, -1]] and b["num_pairs"] == 1


def test_block_causal_mask_keeps_a_packed_rows_sequences_apart():
    mask = block_causal_mask(torch.tensor([[0, 1, 0, 1, 2]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("sp", [2, 3])
def test_each_sequences_last_token_is_in_one_slice_and_the_slices_scores_sum_to_the_whole(packed, sp):
    """A reward model reads a sequence's score at its last token (llmft/objectives/reward.py):
    exactly one slice marks it, and the slices' partial scores add up to the whole row's."""
    batch = collate_pairs(make_pairs(3, seed=1), packed)
    token_scores = torch.randn(*batch["input_ids"].shape, 1)  # a score head's output on every token
    whole = sequence_scores(token_scores, batch["sequence_index"], 6)
    width = -(-batch["input_ids"].shape[1] // sp) * sp
    padded = torch.nn.functional.pad(token_scores, (0, 0, 0, width - batch["input_ids"].shape[1]))
    chunk = width // sp
    parts = []
    for rank in range(sp):
        piece = sequence_slice(batch, rank, sp)
        parts.append(slice_scores(padded[:, rank * chunk : (rank + 1) * chunk], piece, 6))
    marked = sum(int(sequence_slice(batch, rank, sp)["sequence_last"].sum()) for rank in range(sp))
    assert marked == 6
    assert torch.equal(sum(parts), whole)
