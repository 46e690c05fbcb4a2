"""Prompt records (the objectives whose ``ObjectiveSpec.record`` is ``prompts``: ``grpo``): records, tokens, rows, G completions per prompt, micro-batches.

- records: ``{"prompt": "<text>"}`` or ``{"prompt": [messages]}``, with any other fields (a reference
  answer, test cases, ...) that the reward functions read. ``fields: {prompt: question}`` renames
  columns as for SFT records. ``parse_prompt``.
- tokens: the prompt as the model sees it before its completion (``Encoder.prompt_ids_batch``): a
  string exactly as the prompt part of an SFT prompt/completion record, messages through the chat
  template with ``add_generation_prompt=True``. No token is a target. A prompt longer than the room
  the completion leaves (``data.max_seq_len - rollout.max_new_tokens`` tokens) is a malformed record
  (``data.on_bad_record``); its text (the string, or the rendered conversation) is cut to the
  character budget of that room before it is tokenized, so a 50 MB prompt costs what a prompt of
  the room's tokens costs. ``PromptEncoder``.
- rows: one unpacked row per prompt (``build_prompt_rows``), the whole parsed record (after field
  renaming) kept beside it as UTF-8 JSON in the ``TokenDataset``'s ``record`` column; an item
  carries it as ``item["record"]`` (a dict).
- G completions per prompt: ``PromptGroups`` makes position p of the global order completion
  ``p % G`` of the prompt at position ``p // G`` of the prompt order (shuffling, epochs, mixtures and
  streams all act on prompts); ``DataBundle.group_by`` puts it in place of the run's train data.
- micro-batches: ``collate_prompts``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmft.data.arrays import IGNORE_INDEX, Example, take_ranges
from llmft.data.encode import Encoder
from llmft.data.records import BadRecord, Chat, check_not_multimodal, did_you_mean, kind_of, parse_chat, renamed
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from llmft.recipe.schema import DataConfig, Recipe

PROMPT_FIELDS = ("prompt",)


def prompt_room(recipe: Recipe) -> int:
    """The most tokens a prompt may have: what ``rollout.max_new_tokens`` leaves of ``data.max_seq_len``."""
    room = int(recipe.data.max_seq_len) - int(recipe.rollout.max_new_tokens)
    if room < 1:
        raise UserError(room_problem(recipe.data.max_seq_len, recipe.rollout.max_new_tokens, "rollout.max_new_tokens"))
    return room


def room_problem(max_seq_len: int, max_new_tokens: int, where: str) -> Problem:
    return Problem(
        where,
        f"is {max_new_tokens}, which leaves no room for a prompt within data.max_seq_len={max_seq_len}",
        "Lower rollout.max_new_tokens below data.max_seq_len, or raise data.max_seq_len.",
    )


# --- records ----------------------------------------------------------------


@dataclass(frozen=True)
class PromptRecord:
    """A prompt (a string, or the conversation so far) and the whole record as UTF-8 JSON."""

    prompt: str | Chat
    record: bytes


def parse_prompt(value: Any, fields: dict[str, str] | None) -> PromptRecord:
    """One prompt record; ``fields`` maps ``prompt`` (or any other field) to the column holding it."""
    if not isinstance(value, dict):
        raise BadRecord(f"a record must be a JSON object, got {kind_of(value)}")
    if fields:
        value = renamed(value, fields)
    check_not_multimodal(value)
    prompt = value.get("prompt")
    if prompt is None:
        hint = did_you_mean(value, PROMPT_FIELDS, PROMPT_FIELDS)
        if not hint and "messages" in value:
            hint = " (a conversation to continue: name its column with fields: {prompt: messages})"
        raise BadRecord(
            "a prompt record needs 'prompt' (a string, or a list of messages); "
            f"found keys {sorted(map(str, value))}" + hint
        )
    if isinstance(prompt, str):
        if not prompt:
            raise BadRecord("'prompt' is empty")
        parsed: str | Chat = prompt
    elif isinstance(prompt, list):
        try:
            parsed = parse_chat(prompt)
        except BadRecord as e:
            raise BadRecord(f"'prompt': {e}") from None
        if parsed.messages[-1].role == "assistant":
            raise BadRecord(
                "'prompt' ends with an assistant message; a prompt ends with the message the completion "
                "answers (drop the last message, or end with a user or tool message)"
            )
    else:
        raise BadRecord(f"'prompt' must be a string or a non-empty list of messages, got {kind_of(prompt)}")
    return PromptRecord(parsed, _json(value))


def _json(value: dict[str, Any]) -> bytes:
    """The record as UTF-8 JSON; ``BadRecord`` naming the field JSON cannot hold (bytes, dates, ...)."""
    try:
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError):
        for key, v in value.items():
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                raise BadRecord(
                    f"field '{key}' is a {type(v).__name__}, which JSON cannot hold (the record travels with its "
                    "prompt as JSON); convert it to a string or number, or drop the column"
                ) from None
        raise


# --- tokens -----------------------------------------------------------------


@dataclass
class PromptExample(Example):
    """A prompt's ids (no targets) and its record's JSON bytes."""

    record: bytes = b""


class PromptEncoder:
    """Prompt records to ``PromptExample`` s: the prompt's ids, none of them a target, at most ``room`` tokens."""

    keeps_records = True  # ``rows.Tokenize`` writes each record's JSON beside its ids

    def __init__(self, tokenizer: PreTrainedTokenizerBase, room: int, max_seq_len: int) -> None:
        self.encoder = Encoder(tokenizer, "all")
        self.room, self.max_seq_len = room, max_seq_len

    def parse(self, value: Any, fields: dict[str, str] | None) -> PromptRecord:
        return parse_prompt(value, fields)

    def encode_batch(self, prompts: list[PromptRecord]) -> list[PromptExample | BadRecord]:
        """Each prompt's example, or why it is refused. A prompt's text is cut to the character budget
        of ``room`` tokens before it is tokenized (``Encoder.prompt_ids_cut``): one longer than the
        room is refused, as it would be whole, without tokenizing all of it."""
        out: list[PromptExample | BadRecord] = []
        ids_list, cut = self.encoder.prompt_ids_cut([p.prompt for p in prompts], self.room)
        for p, ids, was_cut in zip(prompts, ids_list, cut, strict=True):
            if isinstance(ids, BadRecord):
                out.append(ids)
            elif len(ids) == 0:
                out.append(BadRecord("'prompt' has no tokens"))
            elif len(ids) > self.room:
                out.append(BadRecord(self.too_long(len(ids), was_cut)))
            else:
                out.append(PromptExample(ids, np.full(len(ids), IGNORE_INDEX, dtype=np.int32), p.record))
        return out

    def too_long(self, n: int, cut: bool = False) -> str:
        """Why a prompt of ``n`` tokens is refused (``cut``: ``n`` counts its first characters only)."""
        new = self.max_seq_len - self.room
        size = f"more than the {self.room} tokens" if cut else f"{n} tokens, more than the {self.room}"
        return (
            f"its prompt is {size} that leave room for the completion "
            f"(data.max_seq_len {self.max_seq_len} - rollout.max_new_tokens {new}); shorten the prompt, "
            "raise data.max_seq_len, or lower rollout.max_new_tokens"
        )

    def eval_prompt(self, record: PromptRecord) -> None:
        """Prompts have no reference completion: no exact-match eval prompts."""
        return None


# --- rows -------------------------------------------------------------------


def build_prompt_rows(
    ids: np.ndarray,
    offsets: np.ndarray,
    items: np.ndarray,
    records: tuple[np.ndarray, np.ndarray],
) -> tuple[TokenDataset, dict]:
    """One unpacked row per prompt of ``items`` (every one fits: longer ones were refused when they
    were encoded), each with its record (``records``: offsets and JSON bytes, one per record)."""
    starts, lengths = offsets[items], offsets[items + 1] - offsets[items]
    (flat_ids,) = take_ranges((ids,), starts, lengths)
    rec_offsets, rec_bytes = records
    rec_starts, rec_lengths = rec_offsets[items], rec_offsets[items + 1] - rec_offsets[items]
    (flat_records,) = take_ranges((rec_bytes,), rec_starts, rec_lengths)
    row_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    kept = (np.concatenate([[0], np.cumsum(rec_lengths)]).astype(np.int64), flat_records.astype(np.uint8))
    rows = TokenDataset.from_arrays(
        flat_ids.astype(np.int32), np.zeros(len(flat_ids), np.uint8), row_offsets, records=kept
    )
    stats = {
        "records": len(items),
        "truncated": 0,
        "dropped_no_targets": 0,
        "examples": len(items),
        "tokens": int(row_offsets[-1]),
        "target_tokens": 0,
        "rows": len(items),
    }
    return rows, stats


# --- G completions per prompt -----------------------------------------------


class PromptGroups:
    """Prompts seen as G completions each: position p is completion ``p % G`` of the prompt at
    position ``p // G`` of ``order`` (the prompt-level order: ``GlobalOrder``, ``ProbabilityOrder``
    or a stream's own).

    Indexed by position (its order is ``sampler.Positions``, the identity), so ``MicroBatchSampler`` deals
    completions to ranks and micro-steps and a resume from any position is exact. An item is its
    prompt's item plus ``position``: p. ``len`` counts completions (prompts x G), so an epoch shows
    every prompt G times; a stream has no length, and its epoch and cursor are its prompts'.
    """

    def __init__(self, prompts: Any, order: Any, group: int, seed: int, shuffle: bool) -> None:
        if group < 1:
            raise ValueError(f"G must be >= 1, got {group}")
        self.prompts, self.order, self.group = prompts, order, group
        self.seed, self.shuffle = seed, shuffle  # what ``order`` was built with
        self.packed = False

    @property
    def records(self) -> Any:
        """The data by prompt (what was grouped)."""
        return self.prompts

    def __len__(self) -> int:
        return len(self.prompts) * self.group

    def __getitem__(self, position: int) -> dict[str, Any]:
        item = self.prompts[self.order.index(position // self.group)]
        return {**item, "position": int(position)}

    def prompt_position(self, position: int) -> int:
        return position // self.group

    # A stream's accounting, at the prompt its position falls in.
    def epoch(self, position: int) -> float:
        return self.prompts.epoch(position // self.group)

    def cursor_at(self, position: int) -> Any:
        return self.prompts.cursor_at(position // self.group)

    def restore(self, cursor: Any) -> None:
        self.prompts.restore(cursor)


# --- micro-batches ----------------------------------------------------------


def collate_prompts(examples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """A micro-batch of prompt items: ``prompt_ids`` (each prompt's ids, unpadded), ``records`` (their
    dicts), ``positions`` (their global positions, when the items carry one: training data), and the
    prompts as ``input_ids`` right-padded with ``pad_id``, ``labels`` all IGNORE_INDEX (no targets: a
    count of them is 0) and ``attention_mask``."""
    prompt_ids = [torch.from_numpy(np.asarray(e["input_ids"], dtype=np.int64)) for e in examples]
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        input_ids[row, : len(p)] = p
        mask[row, : len(p)] = 1
    batch: dict[str, Any] = {
        "prompt_ids": prompt_ids,
        "records": [e["record"] for e in examples],
        "input_ids": input_ids,
        "labels": torch.full_like(input_ids, IGNORE_INDEX),
        "attention_mask": mask,
    }
    if "position" in examples[0]:
        batch["positions"] = torch.tensor([e["position"] for e in examples], dtype=torch.long)
    return batch


# --- the kind's code (kinds.KindCode) ------------------------------------------


def encoder(
    tokenizer: PreTrainedTokenizerBase, train_on: str, objective: Any, max_tokens: int | None, room: int | None
) -> PromptEncoder:
    """Prompts are cut to the budget of ``room`` tokens: one longer than ``room`` tokens is refused as
    the whole one would be."""
    assert room is not None and max_tokens is not None, "prompts need the room generation leaves"
    return PromptEncoder(tokenizer, room, max_tokens)


room = prompt_room


def rows(
    ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, items: np.ndarray, cfg: DataConfig, pad_id: int,
    key: str, values: dict | None, records: tuple | None, block: bool = False,
) -> tuple[TokenDataset, dict]:  # fmt: skip
    """``build_prompt_rows``: every prompt that was not refused fits, one row each."""
    assert records is not None, "prompt rows keep their records"
    return build_prompt_rows(ids, offsets, items, records)


def empty(cfg: DataConfig) -> TokenDataset:
    return TokenDataset.empty(records=True)


def open(rows: TokenDataset, cfg: DataConfig, path: Path | None = None) -> TokenDataset:  # noqa: A001
    return rows


def owns(item: dict[str, Any]) -> bool:
    return "record" in item


def totals(stats: dict, cfg: DataConfig) -> None:
    return None


def describe(s: dict) -> str:
    return f"{s['records']:,} records -> {s['rows']:,} prompts, {s['tokens']:,} tokens"


def grouped(records: Any, order: Any, group: int, seed: int, shuffle: bool) -> PromptGroups:
    """Training data as G completions per prompt (``ObjectiveSpec.group``)."""
    return PromptGroups(records, order, group, seed, shuffle)


collate = collate_prompts
