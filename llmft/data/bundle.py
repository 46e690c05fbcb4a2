"""``DataBundle``: the data of a run as the training loop consumes it, and how its order and position work.

An objective that takes each record G times in a row (``ObjectiveSpec.group``: GRPO's G completions
per prompt) has its train data grouped once, by ``build_data`` (``group_by``): ``train`` is then a
``kinds.prompts.PromptGroups`` (the record kind's ``grouped``) indexed by position, whose own order is the identity (``order`` returns it),
and ``num_rows``, ``epoch`` and the stream cursor count positions (prompts x G)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from llmft.data.sampler import GlobalOrder, Positions, ProbabilityOrder
from llmft.errors import Problem, UserError
from llmft.plan.kinds import SEQUENCES

if TYPE_CHECKING:
    import numpy as np

    from llmft.data.mixture import MixedDataset
    from llmft.data.stream import MixedStream, StreamDataset
    from llmft.data.tokens import TokenDataset


@dataclass
class DataBundle:
    """The data of a run, and the one place that knows how its order and position work.

    Cached data is indexed by ``GlobalOrder`` and its position is the sample count alone; streamed
    data (``stream.StreamDataset``) orders itself and also keeps a cursor in the checkpoint
    (``TrainerState.data``) so that a resume does not re-read the stream before it.
    """

    train: TokenDataset | MixedDataset | StreamDataset | MixedStream | Any  # Any: grouped (``group_by``)
    eval: TokenDataset | MixedDataset | None
    eval_prompts: list[tuple[np.ndarray, str]]  # (prompt ids incl. chat template, reference completion)
    stats: dict = field(default_factory=dict)  # train counts at the top level, eval counts under "eval"
    entries: list[dict] = field(default_factory=list)  # one per source: cache entry, built or reused, stats
    streaming: bool = False
    probabilities: list[float] | None = None  # data.mixture=probability: the sources' shares of ``train``
    group: int = 1  # G: consecutive positions that are one record's items (``group_by``)
    kind: str = SEQUENCES  # the record kind of its items (``kinds.RecordKind``): how they are collated
    grouped: bool = False  # ``train`` is ``records`` grouped by ``group_by``

    def group_by(self, group: int, seed: int, shuffle: bool, wrap: Callable[..., Any]) -> None:
        """Make position p of the global order item ``p % G`` of the record at position ``p // G`` of
        the record order (seeded with ``seed``, shuffled or not) by the record kind's ``wrap``
        (``kinds.prompts.grouped``); items then carry ``position``."""
        assert not self.grouped, "the train data is grouped already"
        self.train = wrap(self.train, self.order(seed, shuffle), group, seed, shuffle)
        self.group, self.grouped = group, True
        self.stats["group"] = group

    @property
    def records(self):
        """The train data by record: ``train`` itself, or what ``group_by`` grouped."""
        return self.train.records if self.grouped else self.train

    @property
    def num_rows(self) -> int | None:
        """Training items (positions) per epoch, records x G when grouped; None for a stream (its
        length is unknown until it is read)."""
        return None if self.streaming else len(self.train)

    def order(self, seed: int, shuffle: bool):
        """Position -> index into ``train``."""
        if self.grouped:  # it orders its records itself, as group_by seeded it
            assert (seed, shuffle) == (self.train.seed, self.train.shuffle), "grouped with another seed or shuffle"
            return Positions()
        if self.streaming:
            return Positions()  # a stream's order is the stream (it shuffles inside blocks)
        if self.probabilities is not None:
            return ProbabilityOrder([len(p) for p in self.train.parts], self.probabilities, seed, shuffle)
        return GlobalOrder(len(self.train), seed, shuffle)

    def epoch(self, samples: int) -> float:
        return self.train.epoch(samples) if self.streaming else samples / len(self.train)

    def state_at(self, samples: int) -> dict[str, Any]:
        """What a checkpoint at ``samples`` consumed samples keeps besides the count (``TrainerState.data``)."""
        return {"stream": self.train.cursor_at(samples)} if self.streaming else {}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``state_at``; a stream without a cursor re-reads from its start."""
        cursor = state.get("stream")
        if not self.streaming or cursor is None:
            return
        sources = len(getattr(self.records, "streams", ())) or 1  # a MixedStream's streams, else one
        saved = len(cursor) if isinstance(cursor, list) else 1
        if saved != sources:
            raise UserError(
                Problem(
                    "data.train",
                    f"streams {sources} source(s), but the checkpoint's stream cursor is for {saved}",
                    "Resume with the data.train the checkpoint was trained on, or set checkpoint.resume=never.",
                )
            )
        self.train.restore(cursor)
