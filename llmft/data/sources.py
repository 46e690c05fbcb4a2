"""``data.train`` / ``data.eval`` as a list of sources, each a path or hub id with optional settings.

A source is a string (a file, directory, glob or hub dataset id) or a mapping::

    {path: org/name, split: train, name: config, revision: main, weight: 2,
     train_on: all, fields: {prompt: question, completion: answer}}

``weight`` is a repeat count per epoch: 2 shows every record of the source
twice, 0.5 a seeded half of them (see ``mixture.MixedDataset``); with
``data.mixture: probability``, weight / sum of weights is the source's share
of every window of samples (``sampler.ProbabilityOrder``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from llmft.errors import Problem, UserError

SOURCE_KEYS = ("path", "weight", "split", "name", "revision", "train_on", "fields")
RECORD_FIELDS = ("text", "prompt", "completion", "messages", "chosen", "rejected")  # the last two: preference pairs
TRAIN_ON = ("completion", "all")


@dataclass(frozen=True)
class Source:
    key: str  # the recipe key it came from, e.g. "data.train[1]"
    path: str
    weight: float = 1.0
    split: str | None = None
    name: str | None = None
    revision: str | None = None
    train_on: str | None = None  # None: data.train_on
    fields: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("name", self.name), ("split", self.split)) if v)
        return f"{self.path}{extra}"


def parse_sources(value: Any, key: str, *, weights: bool, open_fields: bool = False) -> list[Source]:
    """The sources of ``data.train`` (``weights=True``) or ``data.eval``; a bad entry is a ``UserError``.
    ``open_fields``: ``fields`` may map any field name (prompt records: the reward functions read them)."""
    if value is None or value == "" or value == []:
        raise UserError(Problem(key, "is not set", f"Set {key} to a JSONL/JSON/Parquet file or directory."))
    if hasattr(value, "items") or isinstance(value, str) or not hasattr(value, "__iter__"):
        items = [value]
        keys = [key]
    else:
        items = list(value)
        keys = [f"{key}[{i}]" for i in range(len(items))]
    sources = [_parse_one(item, k, weights, open_fields) for item, k in zip(items, keys, strict=True)]
    # A single source keeps the plain key in messages, as users wrote it.
    return sources


def _parse_one(item: Any, key: str, weights: bool, open_fields: bool = False) -> Source:
    if isinstance(item, str) or not hasattr(item, "items"):
        return Source(key, str(item))
    spec = {str(k): v for k, v in item.items()}
    unknown = [k for k in spec if k not in SOURCE_KEYS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], SOURCE_KEYS, n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise UserError(
            Problem(f"{key}.{unknown[0]}", "is not a source setting", f"{hint}A source takes {', '.join(SOURCE_KEYS)}.")
        )
    if not spec.get("path"):
        raise UserError(
            Problem(f"{key}.path", "is not set", "Give each source a path (file, directory, glob or hub id).")
        )
    weight = spec.get("weight", 1.0)
    if "weight" in spec and not weights:
        raise UserError(Problem(f"{key}.weight", "has no meaning for eval data", "Remove it; eval uses every record."))
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise UserError(
            Problem(f"{key}.weight", f"must be a number > 0, got {weight!r}", "Use e.g. 2 (twice per epoch) or 0.5.")
        )
    train_on = spec.get("train_on")
    if train_on is not None and train_on not in TRAIN_ON:
        raise UserError(Problem(f"{key}.train_on", f"{train_on!r} is not one of {', '.join(TRAIN_ON)}", ""))
    fields = spec.get("fields") or {}
    if not hasattr(fields, "items"):
        raise UserError(Problem(f"{key}.fields", "must map record fields to column names", "e.g. {prompt: question}"))
    fields = {str(k): str(v) for k, v in fields.items()}
    for name in fields:
        # prompt records (online RL) hand every field to the reward functions: any name may be mapped
        if name not in RECORD_FIELDS and not (open_fields and name.isidentifier()):
            close = difflib.get_close_matches(name, RECORD_FIELDS, n=1)
            hint = f"Did you mean '{close[0]}'? " if close else ""
            raise UserError(
                Problem(
                    f"{key}.fields.{name}",
                    "is not a record field",
                    f"{hint}Map one of {', '.join(RECORD_FIELDS)} to the column that holds it.",
                )
            )
    return Source(
        key,
        str(spec["path"]),
        weight=float(weight),
        split=_opt_str(spec.get("split")),
        name=_opt_str(spec.get("name")),
        revision=_opt_str(spec.get("revision")),
        train_on=train_on,
        fields=fields,
    )


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)
