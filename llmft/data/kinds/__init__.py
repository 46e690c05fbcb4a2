"""Record kinds, the data side: one module of code per kind (``sequences``, ``pairs``, ``prompts``),
found through the kind's record (``llmft.plan.kinds``: the registry, pure). The data layer asks
``kind_code(name)`` for a kind's functions (``KindCode``) instead of switching on its name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from llmft.plan.kinds import SEQUENCES, RecordKind, kind_names, kind_spec

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np

    from llmft.recipe.schema import DataConfig, Recipe


class KindCode(Protocol):
    """The functions a kind's ``code`` module provides (the data side: numpy, torch, tokenizers)."""

    def encoder(self, tokenizer: Any, train_on: str, objective: Any, max_tokens: int | None, room: int | None) -> Any:
        """The ``rows.RecordEncoder`` that parses and tokenizes its records."""

    def room(self, recipe: Recipe) -> int | None:
        """The most tokens a record may have besides ``data.max_seq_len`` (prompts: generation's room)."""

    def rows(
        self, ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, items: np.ndarray, cfg: DataConfig,
        pad_id: int, key: str, values: dict | None, records: tuple | None, block: bool,
    ) -> tuple[Any, dict]:  # fmt: skip
        """Tokenized records -> (cache rows, stats); ``block``: a stream's block (None: no usable row)."""

    def empty(self, cfg: DataConfig) -> Any:
        """No rows, as ``open`` would give them (a stream block with nothing left)."""

    def open(self, rows: Any, cfg: DataConfig, path: Path | None) -> Any:
        """A mapped ``TokenDataset`` of its rows as the items training reads."""

    def collate(self, examples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
        """Items -> a micro-batch."""

    def owns(self, item: dict[str, Any]) -> bool:
        """Whether ``item`` is one of its items (``collate`` of items whose kind is not given)."""

    def totals(self, stats: dict, cfg: DataConfig) -> None:
        """Its own numbers in the summed stats of several entries (e.g. pairs and sequences)."""

    def describe(self, stats: dict) -> str:
        """One entry's stats as ``llmft prepare`` prints them: "N records -> ..."."""


def kind_code(kind: RecordKind | str) -> KindCode:
    """The module with ``kind``'s code."""
    return importlib.import_module((kind_spec(kind) if isinstance(kind, str) else kind).code)  # type: ignore[return-value]


def kind_of_item(item: dict[str, Any]) -> RecordKind:
    """The kind whose item ``item`` is (the first other kind that owns it, else ``sequences``)."""
    for name in kind_names():
        if name != SEQUENCES and kind_code(name).owns(item):
            return kind_spec(name)
    return kind_spec(SEQUENCES)


def make_encoder(
    tokenizer: Any, train_on: str, objective: Any, max_tokens: int | None = None, room: int | None = None
) -> Any:
    """The encoder of ``objective``'s records (``objective``: its ``ObjectiveSpec``)."""
    return kind_code(objective.record).encoder(tokenizer, train_on, objective, max_tokens, room)
