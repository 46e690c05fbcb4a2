"""Preference pairs (the ``pairs`` kind: ``train.objective: dpo``, ``reward``): records, tokens, cache rows, micro-batches.

A pair goes through the SFT pipeline with one item per pair:

- records: ``{"prompt": str, "chosen": str, "rejected": str}``, or message lists
  ``{"prompt": [...], "chosen": [...], "rejected": [...]}``, or an implicit prompt
  ``{"chosen": [...], "rejected": [...]}`` (their shared leading messages). ``parse_pair``.
- tokens: each side is the SFT record it reads as, encoded by the SFT ``Encoder``: chosen is
  ``PromptCompletion(prompt, chosen)`` (or the conversation prompt + chosen), rejected likewise,
  so the targets are the completion and eos (chat: the assistant spans after the shared prompt).
  One ``Tokenize`` row per pair holds chosen then rejected; the target byte's bit 2 marks where
  rejected starts (``PairExample``).
- cache rows: ``build_pair_rows`` truncates each pair (the prompt from the left down to a floor,
  then each completion from the right), drops pairs left without a target in either sequence,
  and stores chosen and rejected as rows ``2i`` and ``2i + 1`` of a ``TokenDataset``;
  ``PairDataset`` is that dataset seen as pairs (``len`` = pairs, an item = both sequences).
- micro-batches: ``collate_pairs`` (the contract in docs/preference.md): 2P right-padded rows,
  chosen and rejected interleaved, or (``data.packing: true``) one padding-free row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmft.data.arrays import IGNORE_INDEX, Example, positions, ranges, take_ranges
from llmft.data.encode import Encoder, left_cut, max_token_chars, text_budget
from llmft.data.records import (
    BadRecord,
    Chat,
    Message,
    PromptCompletion,
    check_not_multimodal,
    did_you_mean,
    kind_of,
    parse_chat,
    renamed,
)
from llmft.data.rows import prefix_counts
from llmft.data.tokens import TokenDataset
from llmft.errors import Problem, UserError
from llmft.limits import CUT_MARGIN

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from llmft.recipe.schema import DataConfig

PAIR_FIELDS = ("prompt", "chosen", "rejected")
REJECTED_START = 2  # bit of the target byte on the first token of rejected, in a Tokenize row
_SFT_KINDS = (("messages", "messages"), ("completion", "prompt/completion"), ("text", "text"))


# --- records ----------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """The two SFT records a pair reads as: prompt + chosen, prompt + rejected."""

    chosen: PromptCompletion | Chat
    rejected: PromptCompletion | Chat


def parse_pair(value: Any, fields: dict[str, str] | None, objective: str) -> Pair:
    """One preference record; ``fields`` maps prompt / chosen / rejected to the columns holding them."""
    if not isinstance(value, dict):
        raise BadRecord(f"a record must be a JSON object, got {kind_of(value)}")
    if fields:
        value = renamed(value, fields)
    value = {k: v for k, v in value.items() if v is not None}
    check_not_multimodal(value)
    if "chosen" not in value and "rejected" not in value:
        kind = next((name for key, name in _SFT_KINDS if key in value), None)
        if kind is not None:
            raise BadRecord(
                f"is a {kind} record, but train.objective is {objective}, which trains on preference pairs "
                "({prompt, chosen, rejected}, or {chosen, rejected} message lists); set train.objective=sft "
                "to train on it"
            )
        raise BadRecord(
            "a preference pair needs 'chosen' and 'rejected' (and 'prompt' unless they are message lists); "
            f"found keys {sorted(map(str, value))}" + did_you_mean(value, PAIR_FIELDS, PAIR_FIELDS)
        )
    for name, other in (("chosen", "rejected"), ("rejected", "chosen")):
        if name not in value:
            raise BadRecord(f"has '{other}' but no '{name}'" + did_you_mean(value, (name,), PAIR_FIELDS))
    chosen, rejected = value["chosen"], value["rejected"]
    if isinstance(chosen, str) or isinstance(rejected, str):
        return _string_pair(value)
    for name in ("chosen", "rejected"):
        if not isinstance(value[name], list) or not value[name]:
            raise BadRecord(f"'{name}' must be a string or a non-empty list of messages, got {kind_of(value[name])}")
    if "prompt" in value:
        prompt = value["prompt"]
        if not isinstance(prompt, list):
            raise BadRecord(
                f"'prompt' is {kind_of(prompt)} but 'chosen' and 'rejected' are message lists: write all three "
                "as strings, or all three as message lists"
            )
        shared = len(prompt)
        chosen, rejected = prompt + chosen, prompt + rejected
    else:  # implicit prompt: the messages the two conversations begin with alike
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b), None)
        shared = min(len(chosen), len(rejected)) if shared is None else shared
    if shared >= len(chosen) or shared >= len(rejected):
        raise BadRecord("'chosen' and 'rejected' need at least one message each after the shared prompt")
    c, r = parse_chat(chosen), parse_chat(rejected)
    return Pair(Chat(c.messages, targets_from=shared), Chat(r.messages, targets_from=shared))


def _string_pair(value: dict[str, Any]) -> Pair:
    if "prompt" not in value:
        raise BadRecord("has 'chosen' and 'rejected' but no 'prompt'" + did_you_mean(value, ("prompt",), PAIR_FIELDS))
    for name in PAIR_FIELDS:
        if not isinstance(value[name], str):
            raise BadRecord(
                f"'{name}' is {kind_of(value[name])}: write 'prompt', 'chosen' and 'rejected' all as strings, "
                "or all as message lists"
            )
    return Pair(
        PromptCompletion(value["prompt"], value["chosen"]), PromptCompletion(value["prompt"], value["rejected"])
    )


# --- tokens -----------------------------------------------------------------


@dataclass
class PairExample(Example):
    """Chosen's tokens then rejected's, in one ``Tokenize`` row; rejected starts at ``split``."""

    split: int = 0

    def target_mask(self) -> np.ndarray:
        mask = super().target_mask()
        mask[self.split] |= REJECTED_START
        return mask


class PairEncoder:
    """Pairs to ``PairExample`` s: each side encoded by the SFT ``Encoder`` as the record it reads as.

    With ``max_tokens`` (``data.max_seq_len``) a pair's texts are cut before the tokenizer sees them,
    so that ``build_pair_rows`` gives the rows of the uncut pair (docs/preference.md, "Truncation"):

    - ``train_on: all``: every token is a target, so no prompt is kept from the left; each sequence
      keeps its first ``max_tokens`` tokens, and each side is cut as the SFT record it reads as.
    - ``train_on: completion``: a pair too long keeps the prompt's *last* tokens (at most
      ``max_tokens``) and each completion's first ones. A completion is cut to ``text_budget``
      characters from the right; a prompt longer than that is cut from the left at ``left_cut``, so
      that its kept tail holds more than ``max_tokens`` tokens, the whole prompt's last ones
      (``_cut_strings``). A conversation is rendered (the messages from the first assistant message
      after the shared prompt cut to the budget first), then the render is cut around where the
      targets begin: on the left at the budget before it, on the right at the budget after it
      (``_cut_chats``).

    A cut pair is used where its tokens show that ``truncate_pair`` keeps the same tokens of it as of
    the whole pair (``_same_rows``): a left-cut prompt of more than ``max_tokens`` tokens, each
    right-cut sequence more than ``max_tokens`` tokens past the prompt. Otherwise (a prompt that is one
    long word, a normaliser that merges characters) the pair is tokenized whole: exact, at the cost
    (bounded by ``limits.RECORD_MAX_BYTES``) the cut avoids elsewhere.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, train_on: str, objective: str, max_tokens: int | None = None
    ) -> None:
        self.encoder = Encoder(tokenizer, train_on)
        self.objective = objective
        self.max_tokens = max_tokens
        self.max_chars = None if max_tokens is None else text_budget(tokenizer, max_tokens)
        self.span = None if max_tokens is None else CUT_MARGIN // 2 * max_token_chars(tokenizer)
        # train_on all, and eval prompts: the SFT cut (a sequence's first max_tokens tokens are exact)
        self.cutter = self.encoder if max_tokens is None else Encoder(tokenizer, train_on, max_tokens)
        self.whole = 0  # pairs too long whose cut could not be shown exact, so tokenized whole (tests, stats)

    def parse(self, value: Any, fields: dict[str, str] | None) -> Pair:
        return parse_pair(value, fields, self.objective)

    def encode_batch(self, pairs: list[Pair]) -> list[PairExample | BadRecord]:
        if self.max_chars is None or self.encoder.train_on == "all":
            return self._encode(pairs, self.cutter)
        out: list[PairExample | BadRecord | None] = [None] * len(pairs)
        strings = [i for i, p in enumerate(pairs) if isinstance(p.chosen, PromptCompletion)]
        chats = [i for i, p in enumerate(pairs) if not isinstance(p.chosen, PromptCompletion)]
        for group, cut in ((strings, self._cut_strings), (chats, self._cut_chats)):
            for i, ex in zip(group, cut([pairs[i] for i in group]) if group else [], strict=True):
                out[i] = ex
        again = [i for i, ex in enumerate(out) if ex is None]
        self.whole += len(again)
        for i, ex in zip(again, self._encode([pairs[i] for i in again], self.encoder), strict=True):
            out[i] = ex
        return out  # type: ignore[return-value]

    def _encode(self, pairs: list[Pair], encoder: Encoder) -> list[PairExample | BadRecord]:
        if not pairs:
            return []
        sides = encoder.encode_batch([p.chosen for p in pairs] + [p.rejected for p in pairs])
        out: list[PairExample | BadRecord] = []
        for c, r in zip(sides[: len(pairs)], sides[len(pairs) :], strict=True):
            if isinstance(c, BadRecord) or isinstance(r, BadRecord):
                bad = c if isinstance(c, BadRecord) else r
                side = "chosen" if bad is c else "rejected"
                out.append(BadRecord(f"{side}: {bad}"))
                continue
            out.append(_pair_example(c, r))
        return out

    def _cut_strings(self, pairs: list[Pair]) -> list[PairExample | None]:
        """Prompt/completion pairs with the prompt cut from the left and the completions from the right
        to the budget; None for a pair whose cut is not shown exact (``_same_rows``) or has no safe
        left cut (``left_cut``): that pair is tokenized whole."""
        budget = self.max_chars
        assert budget is not None and self.span is not None
        cut: list[tuple[Pair, bool, bool, bool] | None] = []
        for pair in pairs:
            c, r = pair.chosen, pair.rejected
            assert isinstance(c, PromptCompletion) and isinstance(r, PromptCompletion)
            at = left_cut(c.prompt, len(c.prompt) - budget, self.span)
            if at is None:
                cut.append(None)
                continue
            prompt = c.prompt[at:] if at else c.prompt
            sides = PromptCompletion(prompt, c.completion[:budget]), PromptCompletion(prompt, r.completion[:budget])
            cut.append((Pair(*sides), at > 0, len(c.completion) > budget, len(r.completion) > budget))
        kept = [x for x in cut if x is not None]
        encoded = iter(self._encode([x[0] for x in kept], self.encoder))
        out: list[PairExample | None] = []
        for x in cut:
            ex = None if x is None else next(encoded)
            out.append(ex if isinstance(ex, PairExample) and self._same_rows(ex, *x[1:]) else None)
        return out

    def _cut_chats(self, pairs: list[Pair]) -> list[PairExample | None]:
        """Conversation pairs: each side rendered, its render cut to the budget before and after where the
        targets of either side begin (or the two renders first differ), the spans masked on the cut text.
        None for a pair to tokenize whole (no safe left cut, a cut not shown exact, a template error or a
        record without a target: the whole pair then gives its own ``BadRecord``)."""
        enc, budget = self.encoder, self.max_chars
        assert budget is not None and self.span is not None
        enc._check_chat_support()
        windows: list[tuple[str, list[tuple[int, int]]]] = []
        cuts: list[tuple[int, bool, bool, bool] | None] = []
        for pair in pairs:
            try:
                found = self._chat_windows(pair, budget, self.span)
            except BadRecord:
                found = None
            if found is None:
                cuts.append(None)
                continue
            (wc, wr), left, right_c, right_r = found
            cuts.append((len(windows), left, right_c, right_r))
            windows += [wc, wr]
        examples = enc._chat_examples(windows, None) if windows else []
        out: list[PairExample | None] = []
        for x in cuts:
            ex = None if x is None else _pair_example(examples[x[0]], examples[x[0] + 1])
            out.append(ex if ex is not None and self._same_rows(ex, *x[1:]) else None)  # type: ignore[misc]
        return out

    def _chat_windows(self, pair: Pair, budget: int, span: int):
        """((chosen text, spans), (rejected text, spans)) cut from the renders, whether the left was cut,
        whether each side's right was; None where the pair is tokenized whole."""
        enc = self.encoder
        sides = []
        for chat in (pair.chosen, pair.rejected):
            assert isinstance(chat, Chat)
            first = next((i for i in range(chat.targets_from, len(chat.messages))
                          if chat.messages[i].role == "assistant"), None)  # fmt: skip
            if first is None:
                return None  # no target: the whole pair says so
            long = any(m.content is not None and len(m.content) > budget for m in chat.messages[first:])
            if long:  # each message from the first target on keeps its first budget characters
                messages = chat.messages[:first] + tuple(
                    Message(m.role, m.content[:budget], m.extras) if m.content is not None else m
                    for m in chat.messages[first:]
                )
                chat = Chat(messages, targets_from=chat.targets_from)
            sides.append((chat, enc._render(chat, None, generation_prompt=False), long))
        (chat_c, full_c, long_c), (chat_r, full_r, long_r) = sides
        begin = _common_prefix(full_c, full_r)
        spans = [enc._target_spans(chat, full, begin + budget) for chat, full, _ in sides]
        begin = min([begin] + [s[0][0] for s in spans if s])
        at = left_cut(full_c, begin - budget, span)
        if at is None:
            return None
        ends = [min(begin + budget, len(full)) for _, full, _ in sides]
        texts = [(full[at:end], [(lo - at, hi - at) for lo, hi in s if lo < end])
                 for (_, full, _), s, end in zip(sides, spans, ends, strict=True)]  # fmt: skip
        return texts, at > 0, long_c or ends[0] < len(full_c), long_r or ends[1] < len(full_r)

    def _same_rows(self, ex: PairExample, left: bool, right_c: bool, right_r: bool) -> bool:
        """Whether ``build_pair_rows`` keeps of the cut pair ``ex`` the tokens it keeps of the whole pair.

        The cut pair is the whole one less ``t`` tokens on the left (the prompt's head) and some on the
        right. While the prompt keeps more than ``max_tokens`` tokens, ``truncate_pair`` cuts it to its
        last ones and both ``over`` and the prompt lose ``t``: the cut moves by ``t``, the rows do not.
        A sequence cut on the right with more than ``max_tokens`` tokens past the prompt makes the pair
        too long either way and the prompt keep its floor (``max_tokens // 2``): the same rows."""
        limit = self.max_tokens
        assert limit is not None
        if not (left or right_c or right_r):
            return True  # nothing was cut: the whole pair
        chosen, rejected = ex.input_ids[: ex.split], ex.input_ids[ex.split :]
        mask = ex.labels != IGNORE_INDEX
        n = min(len(chosen), len(rejected))
        firsts = [n, *np.flatnonzero(chosen[:n] != rejected[:n])[:1]]
        for side in (mask[: ex.split], mask[ex.split :]):
            firsts += list(np.flatnonzero(side)[:1])
        prompt = int(min(firsts))
        if left and prompt <= limit:
            return False
        return all(not cut or len(seq) > prompt + limit for seq, cut in ((chosen, right_c), (rejected, right_r)))

    def eval_prompt(self, pair: Pair) -> tuple[np.ndarray, str] | None:
        """(prompt ids, chosen completion) for generation eval, as for the SFT record prompt + chosen
        (cut to the budget first, as an SFT record's: a cut prompt is longer than any kept prompt)."""
        return self.cutter.eval_prompt(pair.chosen)


def _pair_example(chosen: Example, rejected: Example) -> PairExample:
    ids = np.concatenate([chosen.input_ids, rejected.input_ids])
    labels = np.concatenate([chosen.labels, rejected.labels])
    return PairExample(ids, labels, len(chosen.input_ids))


def _common_prefix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` begin with alike (compared a block at a time)."""
    n, at, step = min(len(a), len(b)), 0, 1 << 16
    while at < n and a[at : at + step] == b[at : at + step]:
        at += step
    while at < n and a[at] == b[at]:
        at += 1
    return min(at, n)


# --- cache rows -------------------------------------------------------------


def truncate_pair(
    chosen: np.ndarray, rejected: np.ndarray, chosen_target: np.ndarray, rejected_target: np.ndarray, max_len: int
) -> tuple[slice, slice]:
    """Which tokens of each sequence a pair keeps so that both fit ``max_len`` (docs/preference.md).

    The prompt is the tokens both sequences begin with, up to the first target of either. While the
    longer sequence is too long, the prompt loses tokens from the left, but keeps at least
    ``min(prompt, max_len // 2)``; then each sequence is cut from the right to ``max_len``.
    """
    n = min(len(chosen), len(rejected))
    differ = np.flatnonzero(chosen[:n] != rejected[:n])
    prompt = int(differ[0]) if len(differ) else n
    for t in (chosen_target, rejected_target):
        hits = np.flatnonzero(t)
        if len(hits):
            prompt = min(prompt, int(hits[0]))
    over = max(len(chosen), len(rejected)) - max_len
    cut = max(0, min(over, prompt - min(prompt, max_len // 2)))
    return slice(cut, min(len(chosen), cut + max_len)), slice(cut, min(len(rejected), cut + max_len))


def build_pair_rows(
    ids: np.ndarray,
    target: np.ndarray,
    offsets: np.ndarray,
    items: np.ndarray,
    cfg: DataConfig,
    key: str,
    allow_empty: bool = False,
) -> tuple[PairDataset, dict]:
    """``build_rows`` for pairs: truncate each pair of ``items`` (``truncate_pair``, vectorised over the
    pairs), drop those without a target in chosen or rejected, store chosen and rejected as rows
    2i and 2i + 1."""
    lo, hi = offsets[items], offsets[items + 1]
    marks = np.flatnonzero(target & REJECTED_START)
    split = marks[np.searchsorted(marks, lo)] if len(items) else lo  # one mark inside each pair's tokens
    len_c, len_r = split - lo, hi - split
    cut = _prompt_cuts(ids, target, lo, split, hi, cfg.max_seq_len)
    keep_c, keep_r = np.minimum(len_c - cut, cfg.max_seq_len), np.minimum(len_r - cut, cfg.max_seq_len)
    truncated = (keep_c < len_c) | (keep_r < len_r)
    targets = (target & 1).astype(np.uint8)
    # labels[0] is never predicted, so a target must lie at position 1 or later of its sequence.
    first = np.concatenate([lo + cut + 1, split + cut + 1])
    last = np.concatenate([lo + cut + keep_c, split + cut + keep_r])
    counts = prefix_counts(targets, np.concatenate([np.minimum(first, last), last]))
    counts = counts[len(first) :] - counts[: len(first)]
    count_c, count_r = counts[: len(items)], counts[len(items) :]
    keep = (count_c > 0) & (count_r > 0)
    pairs = int(keep.sum())
    if pairs == 0 and not allow_empty:
        raise UserError(
            Problem(
                key,
                f"no pair keeps a target token in both chosen and rejected within data.max_seq_len={cfg.max_seq_len}",
                "Raise data.max_seq_len or shorten the prompts.",
            )
        )
    starts = np.stack([lo + cut, split + cut], axis=1)[keep].reshape(-1)  # chosen, rejected, chosen, ...
    lengths = np.stack([keep_c, keep_r], axis=1)[keep].reshape(-1)
    flat_ids, flat_target = take_ranges((ids, targets), starts, lengths)
    row_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = TokenDataset.from_arrays(flat_ids.astype(np.int32), flat_target, row_offsets)
    stats = {
        "records": len(items),
        "truncated": int(truncated.sum()),
        "dropped_no_targets": len(items) - pairs,
        "examples": pairs,
        "tokens": int(row_offsets[-1]),
        "target_tokens": int(count_c[keep].sum() + count_r[keep].sum()),
        "rows": pairs,
        "pairs": pairs,
        "sequences": 2 * pairs,
    }
    return PairDataset(rows, cfg.packing), stats


def _prompt_cuts(
    ids: np.ndarray, target: np.ndarray, lo: np.ndarray, split: np.ndarray, hi: np.ndarray, max_len: int
) -> np.ndarray:
    """How many prompt tokens each pair loses on the left: ``truncate_pair``'s cut, for every pair at once."""
    cut = np.zeros(len(lo), dtype=np.int64)
    over = np.maximum(split - lo, hi - split) - max_len
    long = np.flatnonzero(over > 0)  # only pairs that do not fit have a prompt worth finding
    if len(long) == 0:
        return cut
    lo, split, hi, over = lo[long], split[long], hi[long], over[long]
    hits = np.flatnonzero(target & 1)
    first_c = hits[np.minimum(np.searchsorted(hits, lo), len(hits) - 1)] if len(hits) else lo
    first_r = hits[np.minimum(np.searchsorted(hits, split), len(hits) - 1)] if len(hits) else split
    # the shared prefix is searched only up to the first target of either side and the shorter length
    bound = np.minimum(split - lo, hi - split)
    bound = np.where((first_c >= lo) & (first_c < split), np.minimum(bound, first_c - lo), bound)
    bound = np.where((first_r >= split) & (first_r < hi), np.minimum(bound, first_r - split), bound)
    at_c, at_r = ranges(lo, bound), ranges(split, bound)
    k = at_c - np.repeat(lo, bound)  # position inside the pair
    differ = np.where(ids[at_c] != ids[at_r], k, np.iinfo(np.int64).max)
    prompt = bound.copy()
    some = np.flatnonzero(bound > 0)
    if len(some):
        seg = (np.cumsum(bound) - bound)[some]
        prompt[some] = np.minimum(bound[some], np.minimum.reduceat(differ, seg))
    cut[long] = np.minimum(over, prompt - np.minimum(prompt, max_len // 2))
    return cut


class PairDataset:
    """A pair entry's ``TokenDataset`` (chosen and rejected as rows 2i and 2i + 1) seen as pairs.

    ``len`` is the number of pairs, so the sampler, ``batch.global_batch_size``, mixtures and the
    holdout all count pairs. An item is ``{"chosen": row, "rejected": row}``; each row's
    ``position_ids`` is its ``0 .. n-1`` when ``padding_free`` (``data.packing: true``: the collator
    then concatenates the micro-batch into one row), else None (right-padded rows).
    """

    packed = False  # rows are never bin-packed in the cache; padding-free is a collation layout

    def __init__(self, rows: TokenDataset, padding_free: bool, path: Path | None = None) -> None:
        assert len(rows) % 2 == 0, f"a pair entry holds an even number of rows, not {len(rows)}"
        self.rows, self.padding_free = rows, padding_free
        self.path = path  # the cache entry's Arrow file (precomputed reference log-probs live beside it)
        # preference.precompute_reference: [pairs, 4] float32 (chosen sum, rejected sum, and their
        # target-token counts), attached by llmft.objectives.reference; items then carry the sums.
        self.reference: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.item(i)

    def item(self, i: int, reference: bool = True) -> dict[str, Any]:
        """Pair ``i``; with its reference log-probs (``reference_logps``) when they are attached."""
        if not 0 <= i < len(self):
            raise IndexError(f"pair {i} of {len(self)}")
        item: dict[str, Any] = {"chosen": self.rows[2 * i], "rejected": self.rows[2 * i + 1]}
        if self.padding_free:
            for side in (item["chosen"], item["rejected"]):
                side["position_ids"] = np.arange(len(side["input_ids"]), dtype=np.int64)
        if reference and self.reference is not None:
            item["reference_logps"] = (self.reference[i, 0], self.reference[i, 1])
        return item

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens

    def write(self, path) -> None:
        self.rows.write(path)


# --- micro-batches ----------------------------------------------------------


def collate_pairs(examples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """A micro-batch of P pairs in the layout the preference objectives take (docs/preference.md).

    Sequence ``2p`` is pair p's chosen, ``2p + 1`` its rejected. Unpacked: 2P rows in that order,
    right-padded to the longest, with ``attention_mask``. Padding-free (the rows carry
    ``position_ids``): one row holding every sequence, positions restarting at each, no
    ``attention_mask`` (attention stays within a sequence, as for packed SFT rows), no padding.
    """
    seqs = [e[side] for e in examples for side in ("chosen", "rejected")]
    padding_free = seqs[0]["position_ids"] is not None
    assert all((s["position_ids"] is not None) == padding_free for s in seqs), "mixed padding-free and padded pairs"
    lengths = np.array([len(s["input_ids"]) for s in seqs], dtype=np.int64)
    if padding_free:  # arrays end to end: no Python object per token, however long the pairs
        flat = {
            "input_ids": np.concatenate([s["input_ids"] for s in seqs]).astype(np.int64),
            "labels": np.concatenate([s["labels"] for s in seqs]).astype(np.int64),
            "position_ids": positions(lengths),
            "sequence_index": np.repeat(np.arange(len(seqs), dtype=np.int64), lengths),
        }
        batch = {k: torch.from_numpy(v)[None] for k, v in flat.items()}
    else:
        width = int(lengths.max())
        batch = {
            "input_ids": torch.full((len(seqs), width), pad_id, dtype=torch.long),
            "labels": torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros((len(seqs), width), dtype=torch.long),
            "position_ids": torch.arange(width).repeat(len(seqs), 1),
            "sequence_index": torch.full((len(seqs), width), -1, dtype=torch.long),
        }
        ids_np, labels_np = batch["input_ids"].numpy(), batch["labels"].numpy()  # views into the tensors
        for k, s in enumerate(seqs):
            n = int(lengths[k])
            ids_np[k, :n] = s["input_ids"]
            labels_np[k, :n] = s["labels"]
            batch["attention_mask"][k, :n] = 1
            batch["sequence_index"][k, :n] = k
    batch["num_pairs"] = len(examples)
    if "reference_logps" in examples[0]:  # preference.precompute_reference: [chosen, rejected] per pair
        batch["reference_logps"] = torch.tensor(
            [float(x) for e in examples for x in e["reference_logps"]], dtype=torch.float32
        )
    return batch


# --- the kind's code (kinds.KindCode) ------------------------------------------


def encoder(
    tokenizer: PreTrainedTokenizerBase, train_on: str, objective: Any, max_tokens: int | None, room: int | None
) -> PairEncoder:
    """Pairs are cut to ``max_tokens`` before tokenizing, the prompt from the left as ``truncate_pair``
    keeps its last tokens (``PairEncoder``)."""
    return PairEncoder(tokenizer, train_on, objective.name, max_tokens)


def room(recipe: Any) -> None:
    return None


def rows(
    ids: np.ndarray, target: np.ndarray, offsets: np.ndarray, items: np.ndarray, cfg: DataConfig, pad_id: int,
    key: str, values: dict | None, records: tuple | None, block: bool = False,
) -> tuple[PairDataset, dict]:  # fmt: skip
    """``build_pair_rows``; a stream block whose pairs all lose their targets is an empty block."""
    return build_pair_rows(ids, target, offsets, items, cfg, key, allow_empty=block)


def empty(cfg: DataConfig) -> PairDataset:
    return PairDataset(TokenDataset.empty(), cfg.packing)


def open(rows: TokenDataset, cfg: DataConfig, path: Path | None = None) -> PairDataset:  # noqa: A001
    return PairDataset(rows, cfg.packing, path)


def owns(item: dict[str, Any]) -> bool:
    return "chosen" in item


def totals(stats: dict, cfg: DataConfig) -> None:
    stats.update(pairs=stats["rows"], sequences=2 * stats["rows"])


def describe(s: dict) -> str:
    return (
        f"{s['records']:,} records -> {s['pairs']:,} pairs ({s['sequences']:,} sequences), {s['tokens']:,} tokens "
        f"({s['target_tokens']:,} targets)"
    )


collate = collate_pairs
