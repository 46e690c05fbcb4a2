"""Records to token ids and labels: which tokens are targets.

Labels follow the Hugging Face convention: ``labels[t]`` is the token at
position ``t`` (the model shifts them inside the loss), ``-100`` marks a
non-target. ``labels[0]`` is therefore never a prediction target.

- text: every token is a target; eos is appended.
- prompt/completion: ``tokenizer(prompt)`` (with the tokenizer's own special
  tokens, e.g. bos) followed by ``tokenizer(completion)`` and eos. With
  ``train_on: completion`` only the completion and eos are targets.
- messages: the tokenizer's chat template, tokenized as one string (so the
  tokens are exactly those inference sees). With ``train_on: completion`` the
  targets are the tokens the template emits for each assistant message, found
  by rendering prefixes of the conversation: the characters between
  ``render(messages[:i], add_generation_prompt=True)`` and
  ``render(messages[:i + 1])`` are assistant message ``i``; tokens overlapping
  those characters (by offset mapping) are targets. This works for any
  template that renders prefixes consistently, with or without
  ``{% generation %}`` markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmft.data.records import BadRecord, Chat, PromptCompletion, Record, Text
from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


class Encoder:
    """Tokenizes records for one tokenizer and one ``data.train_on`` choice."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, train_on: str) -> None:
        self.tokenizer = tokenizer
        self.train_on = train_on
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(self, record: Record) -> Example:
        if isinstance(record, Text):
            ids = self._with_eos(self._ids(record.text, special=True))
            return Example(ids, list(ids))
        if isinstance(record, PromptCompletion):
            prompt = self._ids(record.prompt, special=True)
            completion = self._with_eos(self._ids(record.completion, special=False))
            masked = self.train_on == "completion"
            labels = ([IGNORE_INDEX] * len(prompt) if masked else prompt) + completion
            return Example(prompt + completion, labels)
        return self._encode_chat(record)

    def eval_prompt(self, record: Record) -> tuple[list[int], str] | None:
        """(prompt ids, reference text) for generation eval; None for text records."""
        if isinstance(record, PromptCompletion):
            return self._ids(record.prompt, special=True), record.completion
        if isinstance(record, Chat):
            last = max((i for i, m in enumerate(record.messages) if m.role == "assistant"), default=None)
            if last is None:
                return None
            prompt = self._render(record, last, generation_prompt=True)
            return self._ids(prompt, special=False), record.messages[last].content
        return None

    def _with_eos(self, ids: list[int]) -> list[int]:
        # Some tokenizers already append eos themselves (add_eos_token=True); never write it twice.
        return ids if ids[-1:] == self.eos else ids + self.eos

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _encode_chat(self, chat: Chat) -> Example:
        self._check_chat_support()
        full = self._render(chat, None, generation_prompt=False)
        if self.train_on == "all":
            ids = self._ids(full, special=False)  # the template writes its own bos
            return Example(ids, list(ids))
        spans = self._assistant_spans(chat, full)
        if not spans:
            raise BadRecord("has no assistant message, so nothing to train on (data.train_on=completion)")
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        labels = [
            token if any(lo < end and hi > start for start, end in spans) else IGNORE_INDEX
            for token, (lo, hi) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        ]
        return Example(list(enc["input_ids"]), labels)

    def _assistant_spans(self, chat: Chat, full: str) -> list[tuple[int, int]]:
        spans = []
        for i, message in enumerate(chat.messages):
            if message.role != "assistant":
                continue
            before = self._render(chat, i, generation_prompt=True)
            through = self._render(chat, i + 1, generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise BadRecord(
                    f"the chat template does not render messages[:{i}] as a prefix of the conversation, so the "
                    "assistant tokens cannot be located; use data.train_on=all or prompt/completion records"
                )
            spans.append((len(before), len(through)))
        return spans

    def _render(self, chat: Chat, end: int | None, generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError

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
                    "Use a tokenizer with a chat template (an instruct model's), or write prompt/completion records.",
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
