"""Records to token ids and labels: which tokens are targets.

Labels follow the Hugging Face convention: ``labels[t]`` is the token at
position ``t`` (the model shifts them inside the loss), ``-100`` marks a
non-target. ``labels[0]`` is therefore never a prediction target.

- text: every token is a target; eos is appended.
- prompt/completion: ``tokenizer(prompt)`` (with the tokenizer's own special
  tokens, e.g. bos) followed by ``tokenizer(completion)`` and eos. With
  ``train_on: completion`` only the completion and eos are targets.
- messages: the chat template, tokenized as one string (so the tokens are
  exactly those inference sees). With ``train_on: completion`` the targets are
  the tokens the template emits for each assistant message. By definition
  these are the characters between ``render(messages[:i],
  add_generation_prompt=True)`` and ``render(messages[:i + 1])`` for assistant
  message ``i``; tokens overlapping them (by offset mapping) are targets. This
  works for any template that renders prefixes consistently, with or without
  ``{% generation %}`` markers.

Rendering those prefixes for every assistant turn costs the square of the
number of turns, so it is done once per *template layout* instead: a probe
conversation with the same roles and marker contents is rendered prefix by
prefix, which gives the literal text around each message and where each
assistant span starts and ends relative to its content. A real conversation is
then rendered once; when it equals the probe's literals with the real contents
put in (the template did not depend on the contents), its spans follow from
the layout in linear time. Otherwise (contents the template rewrites, such as
``| trim`` of surrounding whitespace, or tool calls it serialises) that one
conversation falls back to the prefix renders: the same masks, only slower.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
from jinja2.exceptions import TemplateError

from llmft.data.arrays import IGNORE_INDEX, Example
from llmft.data.records import BadRecord, Chat, Message, PromptCompletion, Record, Text, parse_record
from llmft.errors import Problem, UserError
from llmft.limits import CALL_CHARS, CUT_MARGIN

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Private-use code points: no template emits them, and trim/strip filters leave them alone.
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"


@dataclass(frozen=True)
class _Layout:
    """A template's rendering of one role sequence: literal text around each content, and assistant spans."""

    literals: tuple[str, ...]  # len(messages) + 1 pieces: before message 0, between, after the last
    spans: tuple[tuple[int, int, int], ...]  # (message index, chars before its content, chars after it)


class Encoder:
    """Tokenizes records for one tokenizer and one ``data.train_on`` choice."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, train_on: str, max_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.train_on = train_on
        # Rows keep max_tokens tokens of a record: its text is cut to a budget of characters that
        # holds more tokens than that before the tokenizer sees it (``_cut``), so a 50 MB record
        # costs what a record of max_tokens tokens costs, not 50 M tokens in Python lists.
        self.max_chars = None if max_tokens is None else text_budget(tokenizer, max_tokens)
        self.max_tokens = max_tokens
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self._layouts: dict[tuple, _Layout | None] = {}
        self._budgets: dict[int, int] = {}  # max_tokens -> text_budget (the vocabulary is read once)
        self.prefix_renders = 0  # conversations that needed the quadratic fallback (for tests and stats)
        # The Rust tokenizer, called without offsets, where that is what tokenizer(texts) runs;
        # checked against tokenizer(texts) on the first batch (``_ids_batch``).
        self._backend = _direct_backend(tokenizer)
        self._backend_checked = False

    @staticmethod
    def parse(value: object, fields: dict[str, str] | None) -> Record:
        """One raw record as the record this encoder takes (``records.parse_record``)."""
        return parse_record(value, fields)

    def encode(self, record: Record) -> Example:
        (out,) = self.encode_batch([record])
        if isinstance(out, BadRecord):
            raise out
        return out

    def encode_batch(self, records: list[Record]) -> list[Example | BadRecord]:
        """Each record's example, or the ``BadRecord`` that says why it cannot be used.

        Records of one kind are tokenized in one call (the fast tokenizer's batch path).
        """
        if self.max_chars is not None:
            return self._encode_cut(records)
        return self._encode(records)

    def _encode_cut(self, records: list[Record]) -> list[Example | BadRecord]:
        """``_encode`` of the records cut to ``max_chars``; the same first ``max_tokens`` tokens.

        A text or prompt/completion cut that yields no more than ``max_tokens`` tokens (a tokenizer
        whose normaliser merges characters, so a token covers more than ``max_token_chars`` of the
        input) is tokenized whole instead: exact, at the memory cost the cut avoids elsewhere."""
        cut = [_cut(r, self.max_chars) for r in records]  # type: ignore[arg-type]
        out = self._encode([c for c, _ in cut])
        again = [i for i, ((c, parts), ex) in enumerate(zip(cut, out, strict=True)) if parts and isinstance(ex, Example)
                 and not isinstance(c, Chat) and len(ex.input_ids) <= self.max_tokens]  # fmt: skip
        for i, ex in zip(again, self._encode([records[i] for i in again]), strict=True):
            out[i] = ex
        return out

    def _encode(self, records: list[Record]) -> list[Example | BadRecord]:
        out: list[Example | BadRecord | None] = [None] * len(records)
        texts = [i for i, r in enumerate(records) if isinstance(r, Text)]
        pcs = [i for i, r in enumerate(records) if isinstance(r, PromptCompletion)]
        chats = [i for i, r in enumerate(records) if isinstance(r, Chat)]
        if texts:
            for i, ids in zip(texts, self._ids_batch([records[i].text for i in texts], special=True), strict=True):
                ids = self._with_eos(ids)
                out[i] = Example(ids, ids)
        if pcs:
            prompts = self._ids_batch([records[i].prompt for i in pcs], special=True)
            completions = self._ids_batch([records[i].completion for i in pcs], special=False)
            masked = self.train_on == "completion"
            for i, prompt, completion in zip(pcs, prompts, completions, strict=True):
                completion = self._with_eos(completion)
                context = np.full(len(prompt), IGNORE_INDEX, dtype=np.int32) if masked else prompt
                out[i] = Example(np.concatenate([prompt, completion]), np.concatenate([context, completion]))
        if chats:
            for i, ex in zip(chats, self._encode_chats([records[i] for i in chats]), strict=True):
                out[i] = ex
        return out  # type: ignore[return-value]

    def eval_prompt(self, record: Record) -> tuple[np.ndarray, str] | None:
        """(prompt ids, reference text) for generation eval; None for text records.

        With ``max_tokens`` the record is cut first (``_cut``): a prompt that was cut is longer than
        any kept prompt, and a reference keeps ``max_chars`` characters."""
        if self.max_chars is not None:
            record = _cut(record, self.max_chars)[0]
        if isinstance(record, PromptCompletion):
            return self._ids(record.prompt, special=True), record.completion
        if isinstance(record, Chat):
            last = max((i for i, m in enumerate(record.messages) if m.role == "assistant"), default=None)
            if last is None or record.messages[last].content is None:
                return None
            prompt = self._render(record, last, generation_prompt=True)
            return self._ids(prompt, special=False), record.messages[last].content
        return None

    def prompt_ids_batch(self, prompts: list[str | Chat]) -> list[np.ndarray | BadRecord]:
        """Each prompt's ids as the model sees them before its completion (online RL prompts): a
        string as the prompt part of a prompt/completion record (``tokenizer(prompt)`` with the
        tokenizer's own special tokens), a conversation rendered by the chat template with
        ``add_generation_prompt=True`` (the template writes bos); a ``BadRecord`` for a
        conversation the template rejects."""
        return self.prompt_ids_cut(prompts, None)[0]

    def prompt_ids_cut(
        self, prompts: list[str | Chat], max_tokens: int | None
    ) -> tuple[list[np.ndarray | BadRecord], list[bool]]:
        """``prompt_ids_batch``, each prompt's text (the string, or the rendered conversation) cut to
        ``text_budget(max_tokens)`` characters before it is tokenized (``cut_ids``): the first
        ``max_tokens`` ids are exact, and a prompt cut gives more than ``max_tokens`` of them; with
        whether each prompt was cut."""
        out: list[np.ndarray | BadRecord | None] = [None] * len(prompts)
        cut = [False] * len(prompts)
        if max_tokens is not None and max_tokens not in self._budgets:
            self._budgets[max_tokens] = text_budget(self.tokenizer, max_tokens)
        budget = self._budgets.get(max_tokens)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        rendered = [(i, prompts[i], True) for i in texts]
        if chats:
            self._check_chat_support()
            for i in chats:
                try:
                    rendered.append((i, self._render(prompts[i], None, generation_prompt=True), False))
                except BadRecord as e:
                    out[i] = e
        for special in (True, False):  # strings with the tokenizer's special tokens; the template writes its own
            group = [(i, text) for i, text, s in rendered if s == special]
            tokenize = partial(self._ids_batch, special=special)
            ids, cuts = cut_ids(tokenize, [t for _, t in group], max_tokens, budget)
            for (i, _), prompt, was_cut in zip(group, ids, cuts, strict=True):
                out[i], cut[i] = prompt, was_cut
        return out, cut  # type: ignore[return-value]

    def _with_eos(self, ids: np.ndarray) -> np.ndarray:
        # Some tokenizers already append eos themselves (add_eos_token=True); never write it twice.
        if self.eos and (len(ids) == 0 or ids[-1] != self.eos[0]):
            return np.concatenate([ids, np.asarray(self.eos, dtype=np.int32)])
        return ids

    def _ids(self, text: str, special: bool) -> np.ndarray:
        return _int32(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _ids_batch(self, texts: list[str], special: bool) -> list[np.ndarray]:
        """Each text's ids as an int32 array. The tokenizer hands its ids over as a Python list per
        text (its own API); texts go to it in calls of at most ``CALL_CHARS`` characters (or one
        text), and each list becomes an array at once, so those lists exist for one call only."""
        out: list[np.ndarray] = []
        for lo, hi in char_batches(texts, CALL_CHARS):
            out += self._ids_call(texts[lo:hi], special)
        return out

    def _ids_call(self, texts: list[str], special: bool) -> list[np.ndarray]:
        if self._backend is None or not _backend_ready(self.tokenizer, self._backend):
            return self._full_ids_batch(texts, special)
        # encode_batch_fast: the same ids as tokenizer(texts) without tracking character
        # offsets or building a BatchEncoding, ~25% less CPU on byte-level BPE.
        ids = [_int32(e.ids) for e in self._backend.encode_batch_fast(texts, add_special_tokens=special)]
        if self._backend_checked:
            return ids
        self._backend_checked = True
        reference = self._full_ids_batch(texts, special)
        if len(ids) != len(reference) or not all(map(np.array_equal, ids, reference)):
            self._backend = None  # a tokenizer that does more than its backend: always the full call
        return reference

    def _full_ids_batch(self, texts: list[str], special: bool) -> list[np.ndarray]:
        return [_int32(ids) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]

    # --- chat ---------------------------------------------------------------

    def _encode_chats(self, chats: list[Chat]) -> list[Example | BadRecord]:
        """Each conversation rendered whole, its text cut to ``max_chars`` (``cut_ids``'s rule: the first
        ``max_tokens`` tokens are the whole text's), the assistant spans (character positions) masked on
        the cut text; spans past the cut are dropped. A cut that gives no more than ``max_tokens`` tokens
        (a merging normaliser) is tokenized whole instead."""
        self._check_chat_support()
        out: list[Example | BadRecord | None] = [None] * len(chats)
        fulls: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        limit = self.max_chars
        for k, chat in enumerate(chats):
            try:
                full = self._render(chat, None, generation_prompt=False)
                spans = self._target_spans(chat, full, limit)
                # every assistant message has a span; those past the cut are dropped, not missing
                if self.train_on != "all" and not any(
                    m.role == "assistant" for m in chat.messages[chat.targets_from :]
                ):
                    after = " after the shared prompt" if chat.targets_from else ""
                    raise BadRecord(
                        f"has no assistant message{after}, so nothing to train on (data.train_on=completion)"
                    )
                fulls[k] = (full, spans)
            except BadRecord as e:
                out[k] = e
        order = list(fulls)
        if not order:
            return out  # type: ignore[return-value]
        examples = self._chat_examples([fulls[k] for k in order], limit)
        again = [j for j, (k, ex) in enumerate(zip(order, examples, strict=True))
                 if len(fulls[k][0]) > limit and len(ex.input_ids) <= self.max_tokens] if limit else []  # fmt: skip
        if again:  # the cut text gave too few tokens to be exact: those conversations whole, with every span
            whole = [(fulls[order[j]][0], self._target_spans(chats[order[j]], fulls[order[j]][0], None)) for j in again]
            for j, ex in zip(again, self._chat_examples(whole, None), strict=True):
                examples[j] = ex
        for k, ex in zip(order, examples, strict=True):
            out[k] = ex
        return out  # type: ignore[return-value]

    def _target_spans(self, chat: Chat, full: str, limit: int | None) -> list[tuple[int, int]]:
        """The spans whose tokens are targets (none for train_on=all), those starting before ``limit``."""
        if self.train_on == "all":
            return []
        spans = self._spans_before(chat, full, limit)
        if chat.targets_from:  # a preference pair: the shared prompt's assistant turns are context
            spans = spans[sum(m.role == "assistant" for m in chat.messages[: chat.targets_from]) :]
        return spans

    def _chat_examples(self, fulls: list[tuple[str, list[tuple[int, int]]]], limit: int | None) -> list[Example]:
        """(rendered text, assistant spans) -> examples, each text cut to ``limit`` characters first."""
        texts = [full if limit is None else full[:limit] for full, _ in fulls]
        if self.train_on == "all":  # the template writes bos
            return [Example(ids, ids) for ids in self._ids_batch(texts, special=False)]
        out: list[Example] = []
        for lo, hi in char_batches(texts, CALL_CHARS):  # offsets: a tuple per token, for one call at a time
            enc = self.tokenizer(texts[lo:hi], add_special_tokens=False, return_offsets_mapping=True)
            for (_, spans), ids, offsets in zip(fulls[lo:hi], enc["input_ids"], enc["offset_mapping"], strict=True):
                ids = _int32(ids)
                out.append(Example(ids, _mask_labels(ids, offsets, spans)))  # spans past the cut hit no token
            del enc
        return out

    def _spans_before(self, chat: Chat, full: str, limit: int | None) -> list[tuple[int, int]]:
        """``assistant_spans`` of the spans that start before ``limit``, found from the fewest leading
        messages whose render begins with ``full[:limit]``: the layout probe and the prefix renders
        are quadratic in the turns, so a record of many short messages costs the turns within the
        budget, not all of them. Each span is a prefix render's length, the same in a conversation's
        leading messages as in the whole one."""
        if limit is None or len(full) <= limit:
            return self.assistant_spans(chat, full)
        n, size = 0, 0
        while n < len(chat.messages) and size <= limit:  # a message renders at least its content
            size += len(chat.messages[n].content or "") + 1
            n += 1
        while n < len(chat.messages):
            head = Chat(chat.messages[:n], targets_from=chat.targets_from)
            try:
                text = self._render(head, None, generation_prompt=False)
            except BadRecord:
                break
            if len(text) >= limit and text[:limit] == full[:limit]:
                return self.assistant_spans(head, text, limit)
            n *= 2
        return self.assistant_spans(chat, full, limit)

    def assistant_spans(self, chat: Chat, full: str, limit: int | None = None) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``full`` (the rendered conversation); with ``limit``,
        only those that start before it (the text is cut there)."""
        layout = self._layout_for(chat)
        if layout is not None:
            spans = _spans_from_layout(layout, chat, full)
            if spans is not None:
                return spans if limit is None else [s for s in spans if s[0] < limit]
        self.prefix_renders += 1
        return self._prefix_spans(chat, full, limit)

    def _prefix_spans(self, chat: Chat, full: str, limit: int | None = None) -> list[tuple[int, int]]:
        """The definition: two prefix renders per assistant message (quadratic in turns). With ``limit``,
        the renders stop at the first assistant message that starts at or past it: the text is cut
        there, and every later span starts later still (each render is a prefix of the next)."""
        spans = []
        for i, message in enumerate(chat.messages):
            if message.role != "assistant":
                continue
            before = self._render(chat, i, generation_prompt=True)
            if limit is not None and len(before) >= limit and full.startswith(before):
                break
            through = self._render(chat, i + 1, generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise BadRecord(
                    f"the chat template does not render messages[:{i}] as a prefix of the conversation, so the "
                    "assistant tokens cannot be located; use data.train_on=all or prompt/completion records"
                )
            spans.append((len(before), len(through)))
        return spans

    def _layout_for(self, chat: Chat) -> _Layout | None:
        # Tool calls and ids are rendered from the data itself, so they have no reusable layout.
        if any(m.extras or m.content is None for m in chat.messages):
            return None
        roles = tuple(m.role for m in chat.messages)
        if roles not in self._layouts:
            self._layouts[roles] = self._probe_layout(roles)
        return self._layouts[roles]

    def _probe_layout(self, roles: tuple[str, ...]) -> _Layout | None:
        markers = [f"{_OPEN}{j}{_CLOSE}" for j in range(len(roles))]
        probe = Chat(tuple(Message(role, marker) for role, marker in zip(roles, markers, strict=True)))
        try:
            full = self._render(probe, None, generation_prompt=False)
            spans = self._prefix_spans(probe, full)
        except BadRecord:
            return None
        literals, cursor, starts = [], 0, []
        for marker in markers:
            at = full.find(marker, cursor)
            if at < 0:
                return None  # the template drops or rewrites content: no layout
            literals.append(full[cursor:at])
            starts.append(at)
            cursor = at + len(marker)
        literals.append(full[cursor:])
        assistants = [j for j, role in enumerate(roles) if role == "assistant"]
        if len(assistants) != len(spans):
            return None
        rel = []
        for j, (lo, hi) in zip(assistants, spans, strict=True):
            rel.append((j, starts[j] - lo, hi - (starts[j] + len(markers[j]))))
        return _Layout(tuple(literals), tuple(rel))

    def _render(self, chat: Chat, end: int | None, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                chat.as_dicts(end), tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as e:
            raise BadRecord(f"the chat template rejected it ({e})") from e

    def _check_chat_support(self) -> None:
        name = self.tokenizer.name_or_path or "the byte tokenizer"
        if not self.tokenizer.chat_template:
            raise UserError(
                Problem(
                    "model.tokenizer",
                    f"'{name}' has no chat template, so 'messages' records cannot be formatted",
                    "Set data.chat_template (a file or a built-in name), use a tokenizer with a chat template "
                    "(an instruct model's), or write prompt/completion records.",
                )
            )
        if self.train_on == "completion" and not self.tokenizer.is_fast:
            raise UserError(
                Problem(
                    "model.tokenizer",
                    f"'{name}' is not a fast tokenizer, so assistant tokens cannot be located by offsets",
                    "Use a tokenizer with a tokenizer.json, or set data.train_on=all.",
                )
            )


def char_batches(texts: list[str], budget: int) -> list[tuple[int, int]]:
    """Consecutive ``(lo, hi)`` ranges of ``texts``, each of at most ``budget`` characters or one text."""
    out, lo, size = [], 0, 0
    for i, text in enumerate(texts):
        if i > lo and size + len(text) > budget:
            out.append((lo, i))
            lo, size = i, 0
        size += len(text)
    if lo < len(texts):
        out.append((lo, len(texts)))
    return out


def _int32(ids) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary entry.

    Byte-level BPE entries are written one character per byte and a byte is at most one
    character; SentencePiece entries are characters (byte-fallback entries, ``<0x41>``, count
    more than they cover). An added token is matched literally, so its length counts too."""
    vocab = tokenizer.get_vocab()
    return max([len(t) for t in vocab] + [len(str(t)) for t in tokenizer.get_added_vocab()] + [1])


def text_budget(tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> int:
    """The characters a text is cut to before it is tokenized when only its first ``max_tokens``
    tokens are kept: ``max_tokens + CUT_MARGIN`` tokens of the longest vocabulary entry each."""
    return (max_tokens + CUT_MARGIN) * max_token_chars(tokenizer)


def cut_ids(
    tokenize: Callable[[list[str]], Sequence], texts: list[str], max_tokens: int | None, max_chars: int | None
) -> tuple[list, list[bool]]:
    """Each text's ids by ``tokenize`` (texts -> ids lists), each text cut to ``max_chars`` first
    (``text_budget(max_tokens)``; None: whole), and whether it was cut.

    A cut text holds more than ``max_tokens`` tokens, the first ``max_tokens`` those of the whole
    text (``_cut``): what the tokenizer sees is bounded by the budget, not by the text. A cut text
    that gives no more than ``max_tokens`` ids (a normaliser that merges characters) is tokenized
    whole instead, so a cut text always gives more than ``max_tokens`` ids and the others are exact."""
    if max_chars is None:
        return list(tokenize(texts)) if texts else [], [False] * len(texts)
    out = list(tokenize([t[:max_chars] for t in texts])) if texts else []
    cut = [len(t) > max_chars for t in texts]
    again = [i for i, c in enumerate(cut) if c and len(out[i]) <= max_tokens]
    for i, ids in zip(again, tokenize([texts[i] for i in again]) if again else [], strict=True):
        out[i], cut[i] = ids, False
    return out, cut


# A plain space after a character that is not whitespace: no token spans it (``left_cut``).
_WORD_START = re.compile(r"\S ")


def left_cut(text: str, start: int, span: int) -> int | None:
    """Where to cut ``text`` on the left to keep its tail from about ``start``: the first position in
    ``[start, start + span]`` holding a plain space after a character that is not whitespace, or None.

    A cut there splits no word: regex pre-tokenizers (GPT-2's and Llama 3's byte-level ones) end every
    piece before such a space and match the rest of the text from it alone, and SentencePiece begins a
    piece at the space (its ``▁``), so the tokens of ``text[cut:]`` are the whole text's tokens
    after the cut, up to those of its first word (a prefix space, a bos). The tail of a left cut is
    exact where a right cut's head is (``_cut``). A text without such a space there (one long word) has
    no safe cut: None, and the caller tokenizes it whole."""
    if start <= 0:
        return 0
    found = _WORD_START.search(text, start - 1, start + span + 1)
    return None if found is None else found.start() + 1


def _cut(record: Record, max_chars: int) -> tuple[Record, bool]:
    """``record`` with each text longer than ``max_chars`` cut to it; whether one was cut.

    Each of those texts alone then holds more than max_tokens + CUT_MARGIN tokens, so the first
    max_tokens tokens of the record are the ones its whole text gives: the cut changes only the
    tokens near it (the split word), past the margin. Chat messages are cut one by one, each to the
    same budget, before the template wraps them (docs/data.md, "Truncation and packing")."""
    if isinstance(record, Text):
        if len(record.text) > max_chars:
            return Text(record.text[:max_chars]), True
    elif isinstance(record, PromptCompletion):
        if len(record.prompt) > max_chars or len(record.completion) > max_chars:
            return PromptCompletion(record.prompt[:max_chars], record.completion[:max_chars]), True
    elif any(m.content is not None and len(m.content) > max_chars for m in record.messages):
        messages = tuple(
            Message(m.role, m.content[:max_chars], m.extras) if m.content is not None else m for m in record.messages
        )
        return Chat(messages), True
    return record, False


def _direct_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` under ``tokenizer`` where ``tokenizer(texts)`` is only its
    ``encode_batch`` (transformers' own ``TokenizersBackend`` path, not overridden), else None."""
    try:  # transformers' internals, whose layout changes between versions: looked up, never required
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the full call only
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or kind.__call__ is not PreTrainedTokenizerBase.__call__
        or kind._encode_plus is not TokenizersBackend._encode_plus
        or hasattr(tokenizer, "_switch_to_input_mode")
        or not hasattr(backend, "encode_batch_fast")
    ):
        return None
    return backend


def _backend_ready(tokenizer, backend) -> bool:
    """Set the backend as ``tokenizer(texts)`` would; False if it truncates or pads (then the full call)."""
    if backend.truncation is not None or backend.padding is not None:
        return False
    split = bool(tokenizer.split_special_tokens)
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    return True


def _spans_from_layout(layout: _Layout, chat: Chat, full: str) -> list[tuple[int, int]] | None:
    """Assistant spans of ``chat`` from its layout, or None when ``full`` does not follow the layout."""
    pieces, starts, pos = [], [], 0
    for literal, message in zip(layout.literals, chat.messages, strict=False):
        pieces.append(literal)
        pos += len(literal)
        starts.append(pos)
        pieces.append(message.content)
        pos += len(message.content)
    pieces.append(layout.literals[-1])
    if "".join(pieces) != full:
        return None
    return [
        (starts[j] - before, starts[j] + len(chat.messages[j].content) + after) for j, before, after in layout.spans
    ]


def _mask_labels(ids: np.ndarray, offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """``ids`` where a token overlaps an assistant span, else IGNORE_INDEX."""
    if not len(ids):
        return np.zeros(0, dtype=np.int32)
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    lo, hi = offs[:, 0], offs[:, 1]
    hit = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        hit |= (lo < end) & (hi > start)
    return np.where(hit, ids, np.int32(IGNORE_INDEX)).astype(np.int32, copy=False)
