"""Token arrays: the encoded record (``Example``), the label that is no target (``IGNORE_INDEX``) and
the vectorised range arithmetic the cache, packing and the record kinds share (``ranges``,
``take_ranges``, ``positions``). A leaf of ``llmft.data``: it imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100
# Which of a batch's tokens are its rows' own (1) and which padding (0), where no attention mask says it:
# packed rows (whose mask transformers must not get) and sequence slices. What counts tokens reads it.
TOKEN_MASK = "token_mask"


@dataclass
class Example:
    """One record's tokens as int32 arrays (lists given are converted): no Python object per token."""

    input_ids: np.ndarray
    labels: np.ndarray  # where every token is a target: the ``input_ids`` array itself (not a copy)

    def __post_init__(self) -> None:
        every = self.labels is self.input_ids
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.labels = self.input_ids if every else np.asarray(self.labels, dtype=np.int32)

    def target_mask(self) -> np.ndarray:
        """The one-byte target mask the cache stores (1 where ``labels`` is the token)."""
        if self.labels is self.input_ids:  # every token a target
            return np.ones(len(self.input_ids), dtype=np.uint8)
        return (self.labels != IGNORE_INDEX).astype(np.uint8)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(lengths) - lengths  # where each range begins in the output
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - first, lengths)


def token_blocks(lengths: np.ndarray, block_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``(lo, hi)`` ranges of items whose ``lengths`` sum to at most ~2 x ``block_tokens``
    (or one longer item): blocks by tokens, not by a count of items sized for the longest one, so a
    1M-token record among short ones does not cut the rest into blocks of a few records."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if len(ends) == 0:
        return []
    cuts = np.searchsorted(ends, np.arange(block_tokens, int(ends[-1]), block_tokens), side="right")
    bounds = np.unique(np.concatenate([[0], np.minimum(cuts, len(ends)), [len(ends)]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


def take_ranges(
    arrays: tuple[np.ndarray, ...], starts: np.ndarray, lengths: np.ndarray, block_tokens: int = 1 << 22
) -> tuple[np.ndarray, ...]:
    """``a[ranges(starts, lengths)]`` for each array, gathered about ``block_tokens`` at a time: the
    8-byte index of each token exists for one block only."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    outs = tuple(np.empty(int(ends[-1]) if len(ends) else 0, dtype=a.dtype) for a in arrays)
    for lo, hi in token_blocks(lengths, block_tokens):
        take = ranges(starts[lo:hi], lengths[lo:hi])
        at = int(ends[lo] - lengths[lo])
        for out, a in zip(outs, arrays, strict=True):
            out[at : at + len(take)] = a[take]
    return outs


def positions(segments: np.ndarray) -> np.ndarray:
    """Position ids (int64) that restart at 0 for every segment, built in place: one 8-byte array
    of the row's length, nothing else per token (a 1M-token row: 8 MB, no temporaries)."""
    lengths = np.asarray(segments, dtype=np.int64)
    lengths = lengths[lengths > 0]
    out = np.ones(int(lengths.sum()), dtype=np.int64)
    if len(out) == 0:
        return out
    out[0] = 0
    starts = np.cumsum(lengths[:-1])
    out[starts] = 1 - lengths[:-1]  # the step back to 0 at each new segment
    return np.cumsum(out, out=out)
