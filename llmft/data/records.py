"""The three record shapes and their validation.

A record is ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [...]}``
(checked in that order of precedence: messages, prompt/completion, text);
other keys are ignored. Anything else raises ``BadRecord`` with a reason that
the caller prefixes with the record's ``file:line``.

Chat messages have a ``role`` (system, user, assistant, tool, or the older
OpenAI name function) and a string ``content``. An assistant message may
carry ``tool_calls`` instead of (or besides) content, and a tool message a
``tool_call_id`` / ``name``; these extra fields go to the chat template as
they are. Content given as a list of parts is accepted when every part is
text (the texts are joined); an image, audio or other part is refused with a
clear reason, since llmft trains text-only models.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Union

ROLES = ("system", "user", "assistant", "tool", "function")
# Message fields besides role/content that templates read (OpenAI / HF conventions).
MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
_MULTIMODAL_RECORD_KEYS = ("images", "image", "audios", "audio", "videos", "video")


class BadRecord(ValueError):
    """A record that cannot be used; the message says why (without the location)."""


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class PromptCompletion:
    prompt: str
    completion: str


@dataclass(frozen=True)
class Message:
    role: str
    content: str | None
    extras: tuple[tuple[str, Any], ...] = ()  # (field, value) of MESSAGE_EXTRAS present in the record

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        d.update(self.extras)
        return d


@dataclass(frozen=True)
class Chat:
    messages: tuple[Message, ...]
    # Assistant messages before this index are context, not targets (a preference pair's shared prompt).
    targets_from: int = 0

    def as_dicts(self, end: int | None = None) -> list[dict[str, Any]]:
        """The first ``end`` messages in the form chat templates take."""
        return [m.as_dict() for m in self.messages[:end]]


Record = Union[Text, PromptCompletion, Chat]


def parse_record(value: Any, fields: dict[str, str] | None = None) -> Record:
    """One record; ``fields`` maps a record field name (text, prompt, ...) to the column holding it."""
    if not isinstance(value, dict):
        raise BadRecord(f"a record must be a JSON object, got {kind_of(value)}")
    if fields:
        value = renamed(value, fields)
    # Parquet and datasets rows carry every column; a null there means "not this shape".
    value = {k: v for k, v in value.items() if v is not None}
    if "messages" in value:
        check_not_multimodal(value)
        return parse_chat(value["messages"])
    if "completion" not in value and ("chosen" in value or "rejected" in value):
        raise BadRecord(
            "is a preference pair ('chosen'/'rejected'), but train.objective is sft, which trains on text, "
            "prompt/completion or messages records; set train.objective=dpo or reward to train on pairs"
        )
    if "prompt" in value or "completion" in value:
        for name in ("prompt", "completion"):
            if name not in value:
                other = "completion" if name == "prompt" else "prompt"
                raise BadRecord(f"has '{other}' but no '{name}'{did_you_mean(value, (name,))}")
            check_str(value[name], f"'{name}'")
        return PromptCompletion(value["prompt"], value["completion"])
    if "text" in value:
        check_str(value["text"], "'text'")
        return Text(value["text"])
    raise BadRecord(
        f"a record needs 'text', 'prompt' and 'completion', or 'messages'; found keys {sorted(map(str, value))}"
        + did_you_mean(value, RECORD_FIELDS)
    )


RECORD_FIELDS = ("text", "prompt", "completion", "messages")


def did_you_mean(value: dict[str, Any], wanted: tuple[str, ...], known: tuple[str, ...] = RECORD_FIELDS) -> str:
    """' (did you mean 'prompt' for 'promt')' for the record keys (not ``known`` fields) that look like a
    misspelt field of ``wanted``."""
    hints = []
    for key in sorted(map(str, value)):
        if key in known:
            continue
        close = difflib.get_close_matches(key, wanted, n=1, cutoff=0.75)
        if close:
            hints.append(f"'{close[0]}' for '{key}'")
    return f" (did you mean {', '.join(hints)})" if hints else ""


def renamed(value: dict[str, Any], fields: dict[str, str]) -> dict[str, Any]:
    out = dict(value)
    for name, column in fields.items():
        if column in value:
            out[name] = out.pop(column) if column != name else value[column]
    return out


def check_not_multimodal(value: dict[str, Any]) -> None:
    for key in _MULTIMODAL_RECORD_KEYS:
        if value.get(key) not in (None, [], ""):
            raise BadRecord(
                f"has '{key}': multimodal records are not supported (llmft trains text-only models); "
                f"drop the '{key}' field to train on the text alone"
            )


def parse_chat(messages: Any) -> Chat:
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"'messages' must be a non-empty list of {{role, content}} objects, got {kind_of(messages)}")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
            raise BadRecord(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise BadRecord(f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")
        content = _content(m.get("content"), i, has_calls=bool(m.get("tool_calls")))
        extras = tuple((k, m[k]) for k in MESSAGE_EXTRAS if m.get(k) is not None)
        if "tool_calls" in dict(extras):
            if m["role"] != "assistant":
                raise BadRecord(
                    f"messages[{i}] has tool_calls but role {m['role']!r}; only assistant messages call tools"
                )
            if not isinstance(m["tool_calls"], list):
                raise BadRecord(f"messages[{i}].tool_calls must be a list, got {kind_of(m['tool_calls'])}")
        parsed.append(Message(m["role"], content, extras))
    return Chat(tuple(parsed))


def _content(content: Any, i: int, has_calls: bool) -> str | None:
    if content is None and has_calls:
        return None
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind is not None:
                raise BadRecord(
                    f"messages[{i}].content[{k}] is a {kind!r} part: multimodal content is not supported "
                    "(llmft trains text-only models); keep only text parts, or write content as a string"
                )
            else:
                raise BadRecord(f"messages[{i}].content[{k}] must be a {{type: text, text: ...}} part")
        return "".join(texts)
    check_str(content, f"messages[{i}].content")
    return content


def check_str(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise BadRecord(f"{name} must be a string, got {kind_of(value)}")


def kind_of(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), f"a number ({value})" if isinstance(value, (int, float)) else type(value).__name__)
