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
import heapq
from dataclasses import dataclass

import numpy as np

from llmft.data.arrays import IGNORE_INDEX, Example, positions, ranges, token_blocks


def plan_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the examples in each row, by best-fit in order.

    Open rows are kept in buckets by the space they have left (at most ``capacity`` distinct
    values), each bucket a heap of row indices: the best fit is the oldest row of the smallest
    space that holds the example, found in O(log) time whatever the number of open rows.
    """
    rows: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # space left -> heap of the rows with that space (oldest first)
    spaces: list[int] = []  # the space values that have a bucket, sorted
    for i, length in enumerate(lengths):
        assert 0 < length <= capacity, (length, capacity)
        k = bisect.bisect_left(spaces, length)
        if k == len(spaces):
            rows.append([i])
            row, space = len(rows) - 1, capacity - length
        else:
            space = spaces[k]
            bucket = buckets[space]
            row = heapq.heappop(bucket)
            if not bucket:
                del buckets[space], spaces[k]
            rows[row].append(i)
            space -= length
        if space > 0:
            if space in buckets:
                heapq.heappush(buckets[space], row)
            else:
                buckets[space] = [row]
                bisect.insort(spaces, space)
    return rows


@dataclass
class PackedRows:
    """Rows of exactly ``max_seq_len`` tokens as flat arrays: row r is ``[r * max_seq_len, (r + 1) * max_seq_len)``.

    ``segments`` (with ``segment_offsets``) lists each row's sequence lengths, the padded tail
    included, from which the position ids follow.
    """

    input_ids: np.ndarray
    target: np.ndarray  # 1 where labels == input_ids, 0 where labels == IGNORE_INDEX
    segments: np.ndarray
    segment_offsets: np.ndarray
    segment_items: np.ndarray  # the example each segment holds (its index in ``starts``), -1 for a padded tail


def pack_arrays(
    input_ids: np.ndarray,
    target: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    max_seq_len: int,
    pad_id: int,
    block_tokens: int = 1 << 22,
) -> PackedRows:
    """Pack examples ``input_ids[starts[i] : starts[i] + lengths[i]]`` (same for ``target``) by ``plan_rows``.

    Tokens are copied ``block_tokens`` at a time, so the 8-byte source and destination index of
    each token exists for one block only, not for the whole dataset."""
    plan = plan_rows([int(n) for n in lengths], max_seq_len)
    members = np.fromiter((i for row in plan for i in row), dtype=np.int64, count=len(lengths))
    row_of = np.repeat(np.arange(len(plan), dtype=np.int64), [len(row) for row in plan])
    member_lens = np.asarray(lengths, dtype=np.int64)[members]
    # Where each member starts inside its row: a running sum that restarts at every row.
    cum = np.cumsum(member_lens) - member_lens
    first_of_row = np.r_[0, np.cumsum([len(row) for row in plan])[:-1]]
    in_row = cum - cum[first_of_row][row_of]
    dest = row_of * max_seq_len + in_row
    src = np.asarray(starts, dtype=np.int64)[members]
    ids = np.full(len(plan) * max_seq_len, pad_id, dtype=input_ids.dtype)
    tgt = np.zeros(len(plan) * max_seq_len, dtype=np.uint8)
    for lo, hi in token_blocks(member_lens, block_tokens):
        d = ranges(dest[lo:hi], member_lens[lo:hi])
        s = ranges(src[lo:hi], member_lens[lo:hi])
        ids[d] = input_ids[s]
        tgt[d] = target[s]
    tgt[dest] = 0  # an example's first token would be predicted from the previous example's last
    used = np.bincount(row_of, weights=member_lens, minlength=len(plan)).astype(np.int64)
    tails = max_seq_len - used
    counts = np.array([len(row) for row in plan], dtype=np.int64) + (tails > 0)
    segments = np.zeros(int(counts.sum()), dtype=np.int32)
    seg_offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    member_segs = seg_offsets[row_of] + (np.arange(len(members)) - first_of_row[row_of])
    segments[member_segs] = member_lens
    has_tail = np.flatnonzero(tails > 0)
    segments[seg_offsets[has_tail + 1] - 1] = tails[has_tail]
    items = np.full(len(segments), -1, dtype=np.int64)
    items[member_segs] = members
    return PackedRows(ids, tgt, segments, seg_offsets, items)


def pack(examples: list[Example], max_seq_len: int, pad_id: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rows of (input_ids, labels, position_ids) arrays, each exactly ``max_seq_len`` long (for
    examples held in memory; the cache packs flat arrays with ``pack_arrays``)."""
    lengths = np.array([len(e.input_ids) for e in examples], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    flat = np.concatenate([e.input_ids for e in examples]).astype(np.int64)
    target = np.concatenate([e.target_mask() for e in examples])
    rows = pack_arrays(flat, target, starts, lengths, max_seq_len, pad_id)
    out = []
    for r in range(len(rows.segment_offsets) - 1):
        ids = rows.input_ids[r * max_seq_len : (r + 1) * max_seq_len]
        tgt = rows.target[r * max_seq_len : (r + 1) * max_seq_len]
        segs = rows.segments[rows.segment_offsets[r] : rows.segment_offsets[r + 1]]
        out.append((ids, np.where(tgt == 1, ids, IGNORE_INDEX), positions(segs)))
    return out
