"""The global sample order and its split into micro-batches: resumable from one integer.

A run consumes an infinite sequence of *positions* 0, 1, 2, ...; position p
is sample ``GlobalOrder.index(p)``. Step s takes positions
``[start + s*G, start + (s+1)*G)`` whatever the layout, and only then are
they dealt out to ranks and micro-steps. So the set of samples of a step is
the same for (micro 8, acc 1, dp 1) and (micro 1, acc 4, dp 2), and the number
of positions consumed is the entire data state of a checkpoint: a resume on
a different world size neither skips nor repeats a sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llmft.plan.batch import BatchPlan


class GlobalOrder:
    """Position -> dataset index; epoch e is a permutation seeded with ``seed + e`` (or identity)."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool) -> None:
        if num_samples <= 0:
            raise ValueError(f"GlobalOrder needs at least one sample, got num_samples={num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._cached_epoch = -1
        self._perm = None  # the current epoch's permutation: int64 numpy (a list would cost ~36 B per sample)

    def epoch(self, position: int) -> int:
        return position // self.num_samples

    def index(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        offset = position % self.num_samples
        if not self.shuffle:
            return offset
        return int(self._permutation(self.epoch(position))[offset])

    def _permutation(self, epoch: int):
        # Positions are read in increasing order, so caching the current epoch suffices.
        if epoch != self._cached_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen).numpy()
            self._cached_epoch = epoch
        return self._perm


class RepeatedSteps:
    """An order whose every global batch is taken ``times`` steps in a row (``ObjectiveSpec.repeats``:
    online RL's policy updates per generation batch): position p reads position
    ``(p // (batch * times)) * batch + p % batch`` of ``order``, so a step's items are the same
    for its ``times`` steps, and the position stays the whole data state of a checkpoint."""

    def __init__(self, order, batch: int, times: int) -> None:
        self.order, self.batch, self.times = order, batch, times

    def index(self, position: int) -> int:
        block, offset = divmod(position, self.batch * self.times)
        return self.order.index(block * self.batch + offset % self.batch)


class MicroBatchSampler:
    """Index lists of one rank's micro-batches, step after step (endless unless ``num_steps``).

    Within step s, rank r takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of
    the step's positions, and micro-step k takes the k-th ``micro_batch_size``
    chunk of that slice. ``plan`` holds G, the micro-batch size, the accumulation
    steps and dp; it has already checked that they multiply out. Usable as a
    DataLoader ``batch_sampler``.
    """

    def __init__(
        self,
        order: GlobalOrder,
        plan: BatchPlan,
        dp_rank: int,
        start_position: int = 0,
        num_steps: int | None = None,
    ) -> None:
        if not 0 <= dp_rank < plan.dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {plan.dp_size})")
        self.order = order
        self.plan = plan
        self.dp_rank = dp_rank
        self.start_position = start_position
        self.num_steps = num_steps

    def position_after(self, steps: int) -> int:
        """The resume state after ``steps`` optimizer steps from the start position."""
        return self.start_position + steps * self.plan.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        micro, first_of_rank = self.plan.micro_batch_size, self.dp_rank * self.plan.local_batch_size
        step = 0
        while self.num_steps is None or step < self.num_steps:
            first = self.position_after(step) + first_of_rank
            for k in range(self.plan.gradient_accumulation_steps):
                lo = first + k * micro
                yield [self.order.index(p) for p in range(lo, lo + micro)]
            step += 1

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("an endless MicroBatchSampler has no length; pass num_steps")
        return self.num_steps * self.plan.gradient_accumulation_steps


class ShareWindows:
    """Position -> (source, its sample number) by exact shares: the windows of ``data.mixture: probability``.

    Positions are cut into windows of ``WINDOW``; window w holds exactly ``counts[k]`` positions
    of source k (its probability times the window, rounded by largest remainder), in an order
    seeded with (seed, w). The j-th position that falls to source k is that source's sample j.
    Cached mixtures (``ProbabilityOrder``) and streamed ones (``stream.MixedStream``) share it.
    """

    WINDOW = 10_000

    def __init__(self, probabilities: list[float], seed: int) -> None:
        self.counts = largest_remainder(probabilities, self.WINDOW)
        self.seed = seed
        self._window = -1
        self._slots: list[int] = []
        self._rank: list[int] = []  # of each slot among the window's slots of its source

    def draw(self, position: int) -> tuple[int, int]:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        w, o = divmod(position, self.WINDOW)
        if w != self._window:
            self._fill(w)
        k = self._slots[o]
        return k, w * self.counts[k] + self._rank[o]

    def taken(self, position: int) -> list[int]:
        """How many of the positions before ``position`` fall to each source."""
        w, o = divmod(position, self.WINDOW)
        out = [w * c for c in self.counts]
        if o:
            self.draw(position - 1)
            for k in self._slots[:o]:
                out[k] += 1
        return out

    def _fill(self, window: int) -> None:
        slots = torch.tensor([k for k, c in enumerate(self.counts) for _ in range(c)])
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 999_983 * (window + 1))
        self._slots = slots[torch.randperm(self.WINDOW, generator=gen)].tolist()
        seen = [0] * len(self.counts)
        self._rank = []
        for k in self._slots:
            self._rank.append(seen[k])
            seen[k] += 1
        self._window = window


class ProbabilityOrder:
    """``data.mixture: probability``: position -> index of a concatenation of sources, by share.

    ``ShareWindows`` deals positions to sources; sample j of source k takes position j of that
    source's own ``GlobalOrder`` (each source has its own epochs). All of it is a pure function
    of (seed, position), so resumes, elastic ones too, are exact.
    """

    WINDOW = ShareWindows.WINDOW

    def __init__(self, lengths: list[int], probabilities: list[float], seed: int, shuffle: bool) -> None:
        self.windows = ShareWindows(probabilities, seed)
        self.counts = self.windows.counts
        self.bases = [sum(lengths[:k]) for k in range(len(lengths))]
        self.orders = [GlobalOrder(n, source_seed(seed, k), shuffle) for k, n in enumerate(lengths)]

    def index(self, position: int) -> int:
        k, j = self.windows.draw(position)
        return self.bases[k] + self.orders[k].index(j)

    def source(self, position: int) -> int:
        return self.windows.draw(position)[0]


def source_seed(seed: int, k: int) -> int:
    """The seed of source k's own sample order in a probability mixture (cached or streamed)."""
    return seed * 1_000_003 + k + 1


def largest_remainder(probabilities: list[float], total: int) -> list[int]:
    """Whole counts summing to ``total`` in proportion to ``probabilities`` (ties: the earlier source)."""
    s = sum(probabilities)
    exact = [p / s * total for p in probabilities]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


def eval_shard(n: int, rank: int, world: int) -> tuple[range, int]:
    """Which of ``n`` eval items ``rank`` of ``world`` evaluates: a contiguous block of ``per =
    ceil(n / world)`` (the last ranks' shorter or empty), and ``per``, what every rank pads its
    share to, so that all ranks make the same (collective) calls."""
    per = -(-n // world)
    return range(min(rank * per, n), min((rank + 1) * per, n)), per


class Positions:
    """The identity order: position p is item p. Grouped data (``kinds.prompts.PromptGroups``) and a
    stream order their items themselves."""

    shuffle = False

    def index(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return position
