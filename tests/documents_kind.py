"""A record kind from outside llmft, and the objective that reads it: one module, two records.

A recipe selects them with ``train.objective: doc_lm`` and ``train.objective_module: documents_kind``
(this file on PYTHONPATH, as tests/ is for the test runner); nothing inside llmft names them
(docs/design.md, "Adding a record kind").

A ``documents`` record is ``{"title": str, "body": str}``: one row ``title\\n\\nbody`` whose targets are
the body's tokens (the title is context), cut to ``data.max_seq_len``, never packed. Its cache entries
have a format of their own. Its micro-batches are SFT's plus ``batch["documents"]``, the number of
documents in the micro-batch, which the objective requires (so a batch collated as SFT rows fails).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmft.data.arrays import IGNORE_INDEX, Example
from llmft.data.kinds import sequences as sft_rows
from llmft.data.records import BadRecord
from llmft.objectives.sft import SFTObjective
from llmft.plan.kinds import RecordKind, register_kind
from llmft.plan.objectives import ObjectiveSpec, register_objective

KIND = register_kind(
    RecordKind(
        name="documents",
        title="titled documents",
        code="documents_kind",
        unit="documents",
        cache_format="documents-1",
    )
)
RECORD = register_objective(
    ObjectiveSpec(
        name="doc_lm",
        title="document LM",
        runtime="documents_kind:DocumentObjective",
        counts="tokens",
        record="documents",
        unit="documents",
        card="doc_lm (next-token loss on each document's body, its title as context)",
    )
)


class DocumentEncoder:
    """``{"title", "body"}`` -> ids of ``title\\n\\nbody`` (+ eos), the body's tokens the targets."""

    keeps_records = False

    def __init__(self, tokenizer: Any, max_tokens: int | None) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens

    def parse(self, value: Any, fields: dict[str, str] | None) -> tuple[str, str]:
        if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("title", "body")):
            raise BadRecord("is not a document ({title: str, body: str})")
        return value["title"], value["body"]

    def encode_batch(self, records: list[tuple[str, str]]) -> list[Example]:
        out = []
        for title, body in records:
            head = self.tokenizer(title + "\n\n", add_special_tokens=False)["input_ids"]
            tail = self.tokenizer(body, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            ids = np.array(head + tail, dtype=np.int32)
            labels = np.concatenate([np.full(len(head), IGNORE_INDEX, np.int32), ids[len(head) :]])
            out.append(Example(ids, labels))
        return out


# --- the kind's code (llmft.data.kinds.KindCode) ---------------------------------


def encoder(tokenizer: Any, train_on: str, objective: Any, max_tokens: int | None, room: int | None):
    return DocumentEncoder(tokenizer, max_tokens)


def room(recipe: Any) -> None:
    return None


def rows(ids, target, offsets, items, cfg, pad_id, key, values, records, block=False):
    """SFT's rows, never packed (``packs`` is False: ``data.packing`` is no part of the cache key)."""
    made, stats = sft_rows.rows(
        ids, target, offsets, items, replace(cfg, packing=False), pad_id, key, values, records, block
    )
    return (None if made is None else Documents(made)), stats


def empty(cfg: Any):
    return Documents(sft_rows.empty(cfg))


def open(rows: Any, cfg: Any, path: Path | None = None) -> Documents:  # noqa: A001
    return Documents(rows)


class Documents:
    """A cache entry's rows, each item marked as a document (``owns``)."""

    packed = False

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.rows[i], "document": True}

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens

    def write(self, path: Path) -> None:
        self.rows.write(path)


def owns(item: dict[str, Any]) -> bool:
    return item.get("document", False) is True


def collate(examples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    return {**sft_rows.collate(examples, pad_id), "documents": torch.tensor(len(examples))}


def totals(stats: dict, cfg: Any) -> None:
    stats["documents"] = stats["rows"]


def describe(s: dict) -> str:
    return (
        f"{s['records']:,} records -> {s['rows']:,} documents, {s['tokens']:,} tokens ({s['target_tokens']:,} targets)"
    )


# --- the objective --------------------------------------------------------------


class DocumentObjective(SFTObjective):
    """SFT's loss over documents' bodies; a micro-batch not collated by this kind is refused."""

    def prepare(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for mb in micro_batches:
            if "documents" not in mb:
                raise AssertionError("a documents micro-batch was not collated by the documents kind")
        return [{k: v for k, v in mb.items() if k != "documents"} for mb in micro_batches]
