"""Packing: several examples per row of exactly ``max_seq_len`` tokens, attention kept apart.

Rows are filled best-fit in dataset order: each example goes to the open row
with the least space that still holds it whole (ties: the oldest row), else
to a new row. Deterministic, never splits an example, and wastes little
space; the training order is shuffled later anyway (``GlobalOrder``).

Inside a row, ``position_ids`` restart at 0 for every example. With
``position_ids`` and no ``attention_mask``, transformers 5
(``masking_utils.find_packed_sequence_indices``) treats every place the
positions do not increase by one as a sequence boundary and builds a
block-diagonal causal mask (sdpa, eager, flex; flash-attention uses varlen
kernels from the same positions). That holds only without a KV cache: the
model must be called with ``use_cache=False``, or the mask silently falls
back to plain causal. The label of each example's first token is set to
-100: in a row it would be predicted from the previous example's last token.
The padded tail gets its own positions 0, 1, ... so it is a separate
(ignored) sequence.
"""

from __future__ import annotations

import bisect

from llmft.data.encode import IGNORE_INDEX, Example


def plan_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the examples in each row, by best-fit in order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted, so bisect finds the best fit
    for i, length in enumerate(lengths):
        assert 0 < length <= capacity, (length, capacity)
        k = bisect.bisect_left(free, (length, -1))
        if k == len(free):
            rows.append([i])
            row, space = len(rows) - 1, capacity - length
        else:
            space, row = free.pop(k)
            rows[row].append(i)
            space -= length
        if space > 0:
            bisect.insort(free, (space, row))
    return rows


def pack(examples: list[Example], max_seq_len: int, pad_id: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Rows of (input_ids, labels, position_ids), each exactly ``max_seq_len`` long."""
    rows = []
    for members in plan_rows([len(e.input_ids) for e in examples], max_seq_len):
        input_ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for i in members:
            ex = examples[i]
            input_ids += ex.input_ids
            labels += [IGNORE_INDEX, *ex.labels[1:]]
            positions += range(len(ex.input_ids))
        tail = max_seq_len - len(input_ids)
        input_ids += [pad_id] * tail
        labels += [IGNORE_INDEX] * tail
        positions += range(tail)
        rows.append((input_ids, labels, positions))
    return rows
