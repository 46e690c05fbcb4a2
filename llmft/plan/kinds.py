"""The record-kind registry: one record per kind of training record, found by one lookup (``kind_spec``).

An objective names the kind of record it reads (``ObjectiveSpec.record``); the data layer asks
that kind's record, never its name, how to parse, encode, cache, open, group and collate it:

- ``sequences``: SFT records (text, prompt/completion, messages), one row each or packed;
- ``pairs``: preference pairs (prompt, chosen, rejected), an item two rows;
- ``prompts``: prompts to complete (online RL), each row keeping its record for the rewards.

A record (``RecordKind``) holds what the data layer and the planner decide by (its cache format,
whether it packs, keeps records, opens fields, gives exact-match eval prompts, carries record
fields, its recipe checks) and names the module with its code (``code``: ``llmft.data.kinds.*``,
imported only when used, as the engine and objective records name theirs; that module provides the
functions of ``llmft.data.kinds.KindCode``). Pure, like the rest of ``llmft.plan``.

Adding a kind is one module and one record: ``register_kind(RecordKind(...))`` from a user's module
(``train.objective_module`` may register the kind and the objective that reads it together;
docs/design.md, "Adding a record kind").
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.errors import Problem, UserError

SEQUENCES = "sequences"  # SFT records: text, prompt/completion, messages; one row each (or packed)
PAIRS = "pairs"  # preference pairs: prompt, chosen, rejected; an item is two rows
PROMPTS = "prompts"  # prompts to complete (online RL): a prompt (text or messages) and any other fields


@dataclass(frozen=True)
class RecordKind:
    """One kind of record: what the data layer decides by, and the module with its code."""

    name: str  # ObjectiveSpec.record
    title: str  # its records, in messages
    code: str  # the module that provides ``KindCode``'s functions, imported when used
    unit: str = "rows"  # a row of its cache, in ``llmft prepare``
    # A cache format of its own (an entry of it names its objective and is never read as another
    # kind's); None: the SFT format (``cache.CACHE_FORMAT``).
    cache_format: str | None = None
    packs: bool = False  # data.packing packs its rows (else a row is an item, packing no part of its key)
    keeps_records: bool = False  # each row keeps its record's JSON (items carry ``record``)
    open_fields: bool = False  # a source's ``fields`` may name any field of its records (they are kept)
    eval_prompts: bool = False  # held-out records give exact-match eval prompts (a reference completion)
    record_fields: bool = False  # it carries an objective's record fields (``ObjectiveSpec.fields``)
    problems: str | None = None  # dotted path: (spec, recipe, where) -> [Problem], pure: what it refuses


_BUILT_IN: tuple[RecordKind, ...] = (
    RecordKind(
        SEQUENCES,
        "SFT records",
        "llmft.data.kinds.sequences",
        packs=True,
        eval_prompts=True,
        record_fields=True,
    ),
    RecordKind(
        PAIRS, "preference pairs", "llmft.data.kinds.pairs", unit="pairs", cache_format="pairs-2", eval_prompts=True
    ),
    RecordKind(
        PROMPTS,
        "prompts",
        "llmft.data.kinds.prompts",
        unit="prompts",
        cache_format="prompts-1",
        keeps_records=True,
        open_fields=True,
        problems="llmft.plan.objectives:prompt_problems",
    ),
)
_BY_NAME: dict[str, RecordKind] = {k.name: k for k in _BUILT_IN}


def register_kind(kind: RecordKind) -> RecordKind:
    """Add ``kind`` (a user module calls this when it is imported); the same record again is a no-op."""
    known = _BY_NAME.get(kind.name)
    if known is not None and known != kind:
        raise UserError(
            Problem(
                "train.objective_module",
                f"registers record kind {kind.name!r}, which is registered already ({known.code})",
                "Give the new kind a name of its own.",
            )
        )
    if kind.cache_format is None and kind.name != SEQUENCES:
        raise UserError(
            Problem(
                "train.objective_module",
                f"registers record kind {kind.name!r} without a cache_format",
                "Give it a cache format of its own, so that its cache entries are never read as SFT rows.",
            )
        )
    _BY_NAME[kind.name] = kind
    return kind


def kind_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def kind_spec(name: str) -> RecordKind:
    """The record of a registered kind (``register_objective`` refused an objective reading another)."""
    kind = _BY_NAME.get(name)
    if kind is None:
        raise AssertionError(f"unknown record kind {name!r}; known: {', '.join(_BY_NAME)}")
    return kind
