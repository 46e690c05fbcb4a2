"""Several cached sources as one dataset: ``MixedDataset`` (``data.mixture: repeat``, weights as
repeats per epoch), ``ConcatDataset`` (eval sources, and the sources of ``data.mixture: probability``)
and ``probabilities`` (the weights as shares of every window of samples)."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np
import torch

from llmft.data.sampler import ProbabilityOrder, largest_remainder
from llmft.data.sources import Source
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError


class MixedDataset:
    """Sources mixed by weight: one epoch holds ``round(weight * len(source))`` rows of each source.

    Weight 2 lists every row of the source twice, 0.5 a seeded half (a fixed
    subset for the run), 1 every row once. Indices run source after source;
    ``GlobalOrder`` shuffles them like any dataset, so the sample order stays
    a pure function of (seed, position) and resumes, also elastic ones, are exact.
    """

    def __init__(self, parts: list[TokenDataset], weights: list[float], seed: int, keys: list[str]) -> None:
        self.parts = parts
        self._full, self._subset, bases = [], [], [0]
        for k, (part, weight) in enumerate(zip(parts, weights, strict=True)):
            n = len(part)
            total = round(weight * n)
            if total == 0:
                raise UserError(Problem(f"{keys[k]}.weight", f"{weight} of {n} rows selects none", "Raise the weight."))
            full, extra = divmod(total, n)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
            self._full.append(full)
            self._subset.append(np.sort(torch.randperm(n, generator=gen)[:extra].numpy()))
            bases.append(bases[-1] + total)
        self._bases = bases
        self.packed = all(p.packed for p in parts)

    def __len__(self) -> int:
        return self._bases[-1]

    def source_of(self, i: int) -> tuple[int, int]:
        """(source index, row in that source) of mixture index ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = bisect_right(self._bases, i) - 1
        r = i - self._bases[k]
        n = len(self.parts[k])
        return k, (r % n if r < self._full[k] * n else int(self._subset[k][r - self._full[k] * n]))

    def __getitem__(self, i: int) -> dict[str, Any]:
        k, row = self.source_of(i)
        return self.parts[k][row]


class ConcatDataset(MixedDataset):
    """Eval sources one after the other."""

    def __init__(self, parts: list[TokenDataset]) -> None:
        super().__init__(parts, [1.0] * len(parts), 0, [""] * len(parts))


def probabilities(sources: list[Source]) -> list[float]:
    """``data.mixture: probability``: each weight over their sum; every source must get a slot per window."""
    total = sum(s.weight for s in sources)
    counts = largest_remainder([s.weight for s in sources], ProbabilityOrder.WINDOW)
    for s, c in zip(sources, counts, strict=True):
        if c == 0:
            raise UserError(
                Problem(
                    f"{s.key}.weight",
                    f"{s.weight} of {total} is less than one sample in {ProbabilityOrder.WINDOW:,}",
                    "Raise the weight, or drop the source.",
                )
            )
    return [s.weight / total for s in sources]
