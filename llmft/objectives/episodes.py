"""Multi-turn episodes of ``rollout.file``: a completion given as the messages after the prompt.

A line's completion may be, instead of a string, the list of messages after the (chat) prompt::

    [{"role": "assistant", "content": "...", "tool_calls": [...]},
     {"role": "tool", "content": "..."},
     {"role": "assistant", "content": "..."}]

Its token ids come from the policy tokenizer's chat template, a segment at a time: the prompt with its
generation prompt is ``Prompt.ids`` (as the data stage made it); then each message's segment is what
rendering the conversation up to it adds to the rendering before it (``add_generation_prompt`` where an
assistant message follows). An assistant message's segment is what the model writes in that turn: its
tokens through its first end-of-sequence token (the tokenizer's eos) are policy tokens; whatever the
template writes after that token, the tool and environment messages, and the header that opens the
next assistant turn are context: in the sequence, not in the loss, not in the global token count
(TRL's ``tool_mask``). Each segment is tokenized on its own and the segments concatenated, as a
multi-turn sampler appends a turn's ids without re-tokenizing the ones before. The completion ends at
the last assistant message's end token, or is cut at ``rollout.max_new_tokens`` tokens (all tokens,
policy and context: the bound on the sequence).
"""

from __future__ import annotations

from typing import Any, Callable

from jinja2 import TemplateError

from llmft.data.encode import cut_ids
from llmft.data.records import BadRecord, parse_chat
from llmft.model.generate import eos_ids

EPISODE_ROLES = ("assistant", "tool", "function", "user")  # after the prompt: the policy, tools, an environment


class Episode(list):
    """An episode's completion token ids (a list of ints, as any backend's completion), with
    ``policy``: per token, whether the policy wrote it; ``messages``: the episode as messages;
    ``text``: its last assistant message's content (what reward functions get as ``completion``).
    A live episode (``llmft.objectives.agent``) also has ``prompt_ids``, its prompt as rendered with
    its tools and its environment's first words (None: the data stage's prompt), ``rewards``, its
    environment's reward by column name, and ``tool_failures`` / ``parse_failures``: tool calls that
    raised, and turns whose tool call did not parse."""

    def __init__(
        self,
        ids: list[int],
        policy: list[bool],
        messages: list[dict[str, Any]],
        text: str,
        prompt_ids: list[int] | None = None,
    ) -> None:
        super().__init__(ids)
        self.policy, self.messages, self.text, self.prompt_ids = policy, messages, text, prompt_ids
        self.rewards: dict[str, float | None] = {}
        self.tool_failures = self.parse_failures = 0

    def cut(self, limit: int) -> Episode:
        """The episode's first ``limit`` tokens (its mask cut alike)."""
        out = Episode(self[:limit], self.policy[:limit], self.messages, self.text, self.prompt_ids)
        out.rewards, out.tool_failures, out.parse_failures = self.rewards, self.tool_failures, self.parse_failures
        return out

    @property
    def turns(self) -> int:
        return sum(m.get("role") == "assistant" for m in self.messages)

    @property
    def tool_calls(self) -> int:
        return sum(len(m.get("tool_calls") or ()) for m in self.messages if m.get("role") == "assistant")


def episode_problem(episode: Any) -> str | None:
    """Why ``episode`` (one item of a line's ``completions``) is not a list of messages after a
    prompt, or None: messages as a data record's (``parse_chat``), roles among ``EPISODE_ROLES``, the
    first one the policy's (assistant)."""
    try:
        chat = parse_chat(episode)
    except BadRecord as e:
        return str(e)
    for i, m in enumerate(chat.messages):
        if m.role not in EPISODE_ROLES:
            return f"messages[{i}].role {m.role!r} is not one of {', '.join(EPISODE_ROLES)} (after the prompt)"
    if chat.messages[0].role != "assistant":
        return f"starts with a {chat.messages[0].role!r} message, not the policy's (assistant)"
    return None


def episode_ids(
    tokenizer: Any,
    prompt: list[dict[str, Any]],
    episode: list[dict[str, Any]],
    limit: int,
    budget: int,
) -> Episode:
    """The completion ids of ``episode`` after ``prompt`` (both messages) and their policy mask, at
    most ``limit`` tokens (module docstring). A ``ValueError`` saying why where the template does not
    render the conversation's prefixes as prefixes of it (then no token split can be trusted)."""
    messages = parse_chat(prompt).as_dicts() + parse_chat(episode).as_dicts()
    start = len(messages) - len(episode)
    ends = set(eos_ids(tokenizer))
    tokenize: Callable[[list[str]], list] = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids: list[int] = []
    policy: list[bool] = []
    before = render(tokenizer, messages[:start], True)
    for k in range(start, len(messages)):
        assistant = messages[k]["role"] == "assistant"
        opens = not assistant and k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
        after, text = _delta(tokenizer, messages, k, before, opens, start)
        room = limit - len(ids)
        segment = list(cut_ids(tokenize, [text], room, budget)[0][0])[:room]
        mine = [False] * len(segment)
        if assistant:  # what the model writes in this turn: through its end token; the rest is the template's
            end = next((i + 1 for i, t in enumerate(segment) if t in ends), len(segment))
            mine[:end] = [True] * end
            if k == len(messages) - 1:  # the episode ends where the model stopped
                segment, mine = segment[:end], mine[:end]
        ids += segment
        policy += mine
        before = after
        if len(ids) >= limit:
            break
    last = next((m for m in reversed(messages[start:]) if m["role"] == "assistant"), {})
    return Episode(ids, policy, episode, last.get("content") or "")


def context_ids(tokenizer: Any, messages: list[dict[str, Any]], turn: int, tools: list | None = None) -> list[int]:
    """The context tokens a live episode appends after its assistant message ``messages[turn]``
    (``llmft.objectives.agent``): what the template writes after that message's end token, then the
    segment of each later message (tool results, an environment's words), the last one opening the
    next assistant turn. The same tokens ``episode_ids`` makes of these messages (module docstring)."""
    tokenize = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    ends = set(eos_ids(tokenizer))
    before = render(tokenizer, messages[:turn], True, tools)
    before, text = _delta(tokenizer, messages, turn, before, False, 0, tools)
    segment = tokenize([text])[0]
    ids = list(segment[next((i + 1 for i, t in enumerate(segment) if t in ends), len(segment)) :])
    for k in range(turn + 1, len(messages)):
        before, text = _delta(tokenizer, messages, k, before, k == len(messages) - 1, 0, tools)
        ids += tokenize([text])[0]
    return ids


def _delta(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    k: int,
    before: str,
    opens: bool,
    start: int,
    tools: list | None = None,
) -> tuple[str, str]:
    """(the rendering through message ``k``, what it adds to ``before``, the rendering before it);
    a ``ValueError`` where it does not begin with ``before``."""
    after = render(tokenizer, messages[: k + 1], opens, tools)
    if not after.startswith(before):
        raise ValueError(
            f"the chat template does not render the conversation up to message {k - start} of the episode "
            "as a prefix of the conversation up to the next one, so the policy's tokens cannot be told "
            "from the template's"
        )
    return after, after[len(before) :]


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, tools: list | None = None) -> str:
    """The chat template's text of ``messages`` (with ``tools``' schemas where given); a ``ValueError``
    with the template's own message where it refuses them."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **({"tools": tools} if tools else {})
        )
    except TemplateError as e:
        raise ValueError(f"the chat template rejected it ({e})") from e
