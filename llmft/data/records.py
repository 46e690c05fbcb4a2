"""The three record shapes and their validation.

A record is ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [...]}``
(checked in that order of precedence: messages, prompt/completion, text);
other keys are ignored. Anything else raises ``BadRecord`` with a reason that
the caller prefixes with the record's ``file:line``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

ROLES = ("system", "user", "assistant")


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
    content: str


@dataclass(frozen=True)
class Chat:
    messages: tuple[Message, ...]

    def as_dicts(self, end: int | None = None) -> list[dict[str, str]]:
        """The first ``end`` messages in the form chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages[:end]]


Record = Union[Text, PromptCompletion, Chat]


def parse_record(value: Any) -> Record:
    if not isinstance(value, dict):
        raise BadRecord(f"a record must be a JSON object, got {_kind(value)}")
    # Parquet and datasets rows carry every column; a null there means "not this shape".
    value = {k: v for k, v in value.items() if v is not None}
    if "messages" in value:
        return _parse_chat(value["messages"])
    if "prompt" in value or "completion" in value:
        for name in ("prompt", "completion"):
            if name not in value:
                other = "completion" if name == "prompt" else "prompt"
                raise BadRecord(f"has '{other}' but no '{name}'")
            _check_str(value[name], f"'{name}'")
        return PromptCompletion(value["prompt"], value["completion"])
    if "text" in value:
        _check_str(value["text"], "'text'")
        return Text(value["text"])
    raise BadRecord(
        f"a record needs 'text', 'prompt' and 'completion', or 'messages'; found keys {sorted(map(str, value))}"
    )


def _parse_chat(messages: Any) -> Chat:
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"'messages' must be a non-empty list of {{role, content}} objects, got {_kind(messages)}")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadRecord(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise BadRecord(f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")
        _check_str(m["content"], f"messages[{i}].content")
        parsed.append(Message(m["role"], m["content"]))
    return Chat(tuple(parsed))


def _check_str(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise BadRecord(f"{name} must be a string, got {_kind(value)}")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), f"a number ({value})" if isinstance(value, (int, float)) else type(value).__name__)
