"""Multi-turn episodes generated live: tools and environments (``rollout.tools``, ``rollout.environment``).

An episode is one completion of the batch equation (G per prompt). Its turns are drawn by the
rollout's ``Generator`` (``hf`` or ``vllm``), every rank in step; between turns the tools the policy
called run here, in the training process (TRL's contract), and their results go back as tool messages:

1. The prompt: the record's messages, the environment's first words (``reset(**record)``: None, or
   text appended to the last user message), rendered by the chat template with the tools' schemas
   (``tools=``: what a template that lists tools shows the model). ``Episode.prompt_ids``.
2. A turn: the policy's tokens drawn after everything so far, up to its first eos or the episode's
   budget (``rollout.max_new_tokens`` counts every token after the prompt, policy and context). Its
   ids are kept as drawn, never re-tokenized from text: they are what is trained (policy tokens).
3. The turn is read for tool calls: by transformers' ``parse_response`` where the tokenizer has a
   ``response_template`` (TRL's ``add_response_schema`` sets one for known templates), otherwise its
   text (special tokens kept, its eos dropped) by the template's own convention (``CallFormat``:
   what the template writes for an assistant's ``tool_calls``: ``<tool_call>`` blocks, a JSON list
   of calls, or JSON call objects). No call: the episode ends. A call that does not parse ends it
   too, counted (``parse_failures``).
4. Each call runs (a tool function, or an environment's method): what it returns is the tool
   message's content (text as is, anything else as JSON); a call that raises or names no tool gives
   the model ``{"error": ...}`` as its result, counted (``tool_failures``). A call that does not
   return within ``rollout.tool_timeout_s`` (its own thread, left running) is a failure too and ends
   the episode at that turn; its environment is replaced for the slot's next episodes. Then the context tokens:
   what the template writes after the turn's eos, the tool messages, the next turn's header
   (``llmft.objectives.episodes.context_ids``: the tokens ``rollout.file`` makes of the same
   messages). Context is in the sequence, not in the loss or the token count.
5. The episode ends without a call, at ``rollout.max_turns`` turns, past ``rollout.max_tool_calls``
   calls, when a turn is cut by the budget, or when the next context would not leave a token of it.
   Then an environment with ``get_reward()`` gives its column (named after its class).

Sampling is seeded per turn from the generation batch's seed: the same records, weights and tools
give the same episodes, so a run killed anywhere (a tool call included) and resumed regenerates its
step exactly (a late tool call depends on the clock: it is the exception). Every rank calls the
generator once per turn while any rank has an episode going, in as many calls as the busiest rank
(a rank with fewer episodes going draws discarded rows of its first prompt): sharded engines join
every forward, and the generator's stop vote is a collective.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from llmft.data.encode import text_budget
from llmft.errors import Problem, UserError
from llmft.job import watchdog
from llmft.job.dist import all_reduce_max
from llmft.objectives.episodes import Episode, context_ids, render
from llmft.objectives.rollout import end_at_eos
from llmft.plan.rl import environments_of, import_function

if TYPE_CHECKING:
    from llmft.objectives.rollout import GeneratedRollout, Prompt
    from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

PROBE = {"type": "function", "function": {"name": "llmft_probe", "arguments": {"x": 1}}}
TEMPLATE_FIX = (
    "Use a chat template that writes an assistant's tool_calls (data.chat_template: llmft, chatml or llama3 "
    "do), as the model was trained to write them."
)


@dataclass
class Environments:
    """``rollout.environment``'s classes by name (None: the one class for every record), the tool
    methods of each, which give a reward column (``get_reward``), and a pool of instances per name."""

    factories: dict[str | None, Any]
    methods: dict[str | None, list[str]]
    rewarded: list[str]  # class names with get_reward(), the reward columns (one per class)
    pool: dict[str | None, list[Any]] = field(default_factory=dict)

    def instance(self, name: str | None, slot: int) -> Any:
        """The ``slot``-th instance of environment ``name`` (made once, reset per episode)."""
        made = self.pool.setdefault(name, [])
        while len(made) <= slot:
            made.append(self.factories[name]())
        return made[slot]

    def replace(self, instance: Any) -> None:
        """A fresh instance in ``instance``'s slot (a tool method of it never returned: its thread may
        still change it), for the slot's next episodes."""
        for name, made in self.pool.items():
            for slot, other in enumerate(made):
                if other is instance:
                    made[slot] = self.factories[name]()
                    return


def load_environments(value: Any) -> Environments | None:
    """``rollout.environment`` imported, each class made once and checked (it must have ``reset``);
    a ``UserError`` naming the key otherwise."""
    named = environments_of(value)
    if not named:
        return None
    factories, methods, rewarded, pool = {}, {}, [], {}
    for name, target in named.items():
        key = "rollout.environment" + (f".{name}" if name is not None else "")
        factory = import_function(target, key)
        try:
            instance = factory()
        except Exception as e:
            raise UserError(
                Problem(
                    key,
                    f"{target}() raised {type(e).__name__}: {e}",
                    "Fix the class's __init__ (it takes no arguments).",
                )
            ) from e
        members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
        if "reset" not in members:
            raise UserError(
                Problem(
                    key,
                    f"{target} has no reset method",
                    "Give the class reset(self, **record) returning None or text for the last user message (TRL's "
                    "environment_factory contract).",
                )
            )
        factories[name], pool[name] = factory, [instance]
        methods[name] = [m for m in members if m not in ("reset", "get_reward") and not m.startswith("_")]
        if "get_reward" in members and type(instance).__name__ not in rewarded:
            rewarded.append(type(instance).__name__)
    return Environments(factories, methods, rewarded, pool)


class CallFormat:
    """How the chat template writes an assistant's tool calls, learnt by rendering one: ``hermes``
    (``<tool_call>`` JSON ``</tool_call>`` blocks), ``list`` (a JSON list of calls) or ``objects``
    (JSON call objects one after another), and how the model's text is read back into calls."""

    def __init__(self, tokenizer: Any, tools: list[Callable[..., Any]]) -> None:
        self.tokenizer = tokenizer
        if getattr(tokenizer, "response_template", None) is not None:  # the tokenizer parses its own responses
            self.kind = "transformers"
            return
        user = [{"role": "user", "content": "x"}]
        try:
            before = render(tokenizer, user, True, tools or None)
            after = render(
                tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [PROBE]}], False, tools or None
            )
        except ValueError as e:
            raise UserError(
                Problem("rollout.tools", f"the chat template cannot render a tool call: {e}", TEMPLATE_FIX)
            ) from e
        written = after[len(before) :] if after.startswith(before) else ""
        if "llmft_probe" not in written:
            raise UserError(
                Problem("rollout.tools", "the chat template does not write an assistant's tool_calls", TEMPLATE_FIX)
            )
        written = written.lstrip()
        self.kind = "hermes" if "<tool_call>" in written else ("list" if written.startswith("[") else "objects")

    def read(
        self, ids: list[int], prefix: list[int], text: str, tools: list[Callable[..., Any]]
    ) -> tuple[str, list[dict[str, Any]], bool]:
        """A turn's (content, calls, whether a call did not parse): by transformers' ``parse_response``
        where the tokenizer has a ``response_template`` (the turn's ids after ``prefix``, arguments
        cast by the tools' schemas), by ``parse`` of its ``text`` otherwise."""
        if self.kind != "transformers":
            return self.parse(text)
        try:
            message = self.tokenizer.parse_response(list(ids), prefix=list(prefix), tools=tools or None)
        except Exception:  # the template's parser refused the turn: a call that does not parse
            return text, [], True
        calls = [call_of(c) for c in message.get("tool_calls") or []]
        if any(c is None for c in calls):
            return text, [], True
        return message.get("content") or "", calls, False  # type: ignore[return-value]

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]], bool]:
        """(the content before the calls, the calls as ``{"type": "function", "function": {"name",
        "arguments"}}``, whether the text tried a call that does not parse)."""
        if self.kind == "hermes":
            start = text.find("<tool_call>")
            if start < 0:
                return text, [], False
            blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text[start:], flags=re.DOTALL)
            calls = [call_of(_json(b.strip())) for b in blocks]
            bad = not blocks or any(c is None for c in calls) or text.count("<tool_call>") != len(blocks)
            return text[:start], ([] if bad else calls), bad  # type: ignore[return-value]
        opener = "[" if self.kind == "list" else "{"
        for start in (i for i, ch in enumerate(text) if ch == opener):  # the first place calls parse to the end
            values, rest = _json_values(text[start:])
            if self.kind == "list":
                values = values[0] if len(values) == 1 and isinstance(values[0], list) else []
            calls = [call_of(v) for v in values]
            if calls and not rest.strip() and all(c is not None for c in calls):
                return text[:start], calls, False  # type: ignore[return-value]
        return text, [], '"name"' in text  # a call was tried (a name given) and did not parse


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_values(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of ``text``, one after another, and what follows them."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text) or text[at] not in "[{":
            return values, text[at:]
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return values, text[at:]
        values.append(value)


def call_of(value: Any) -> dict[str, Any] | None:
    """A tool call as chat templates take it, from ``{"type": "function", "function": {name, arguments}}``
    or ``{name, arguments}`` (arguments a mapping or its JSON text); None where it is not one."""
    if not isinstance(value, dict):
        return None
    fn = value.get("function", value)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def run_call(
    tools: dict[str, Callable[..., Any]], call: dict[str, Any], timeout_s: float | None = None
) -> tuple[str, bool, bool]:
    """A tool call's result as a tool message's content, whether it failed (the tool raised, there is
    no tool of that name, or it did not return within ``timeout_s``): then the content is
    ``{"error": ...}``, what the model sees; and whether it was late. With a ``timeout_s`` the tool
    runs in a thread of its own, left running when late (Python cannot stop a thread)."""
    name, args = call["function"]["name"], call["function"]["arguments"]
    fn = tools.get(name)
    if fn is None:
        known = ", ".join(sorted(tools)) or "none"
        return json.dumps({"error": f"no tool named {name!r} (tools: {known})"}), True, False
    box: dict[str, Any] = {}
    # the model called it wrong, or the tool failed: the model is told. In the training thread a
    # KeyboardInterrupt or SystemExit is the run's, not the tool's; in a thread of its own it ends only the call
    caught = Exception if timeout_s is None else BaseException

    def run() -> None:
        try:
            box["result"] = fn(**args)
        except caught as e:  # noqa: BLE001
            box["error"] = e

    if timeout_s is None:
        run()
    else:
        thread = threading.Thread(target=run, name=f"llmft-tool-{name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            late = f"TimeoutError: {name} did not return within rollout.tool_timeout_s={timeout_s:g} s"
            return json.dumps({"error": late}), True, True
    if "error" in box:
        e = box["error"]
        return json.dumps({"error": f"{type(e).__name__}: {e}"}), True, False
    result = box["result"]
    if isinstance(result, str):
        return result, False, False
    try:
        return json.dumps(result, ensure_ascii=False), False, False
    except (TypeError, ValueError):
        return str(result), False, False


@dataclass
class Going:
    """One episode being drawn."""

    prompt: Prompt
    prompt_ids: list[int]
    messages: list[dict[str, Any]]  # the prompt's, then the episode's
    start: int  # where the episode's messages begin
    tools: dict[str, Callable[..., Any]]
    schemas: list[Callable[..., Any]]
    env: Any = None
    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    calls: int = 0
    tool_failures: int = 0
    parse_failures: int = 0
    done: bool = False

    def episode(self, rewarded: list[str]) -> Episode:
        episode = self.messages[self.start :]
        last = next((m for m in reversed(episode) if m["role"] == "assistant"), {})
        out = Episode(self.ids, self.policy, episode, last.get("content") or "", self.prompt_ids)
        out.tool_failures, out.parse_failures = self.tool_failures, self.parse_failures
        name = type(self.env).__name__ if self.env is not None else None
        for column in rewarded:
            out.rewards[column] = reward_of(self.env, self.prompt) if column == name else None
        return out


def reward_of(env: Any, prompt: Prompt) -> float | None:
    """An environment's ``get_reward()`` for its episode: a finite number or None."""
    where = f"rollout.environment ({type(env).__name__}.get_reward)"
    try:
        value = env.get_reward()
    except Exception as e:
        raise UserError(
            Problem(where, f"raised {type(e).__name__}: {e} for the prompt {_shown(prompt)}", "Fix get_reward.")
        ) from e
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise UserError(
            Problem(
                where,
                f"returned {repr(value)[:200]} ({type(value).__name__}) for the prompt {_shown(prompt)}",
                "Return a finite float, or None (no opinion).",
            )
        )
    return float(value)


def _shown(prompt: Prompt) -> str:
    return json.dumps(prompt.record.get("prompt"), ensure_ascii=False)[:200]


class AgentRollout:
    """``rollout.tools`` / ``rollout.environment``: G episodes per prompt over a ``GeneratedRollout``'s
    generator (module docstring). Answers ``complete`` and ``complete_scored`` as the rollout does,
    with ``Episode`` completions."""

    def __init__(self, recipe: Recipe, rollout: GeneratedRollout, tokenizer: Any, device: torch.device) -> None:
        cfg = recipe.rollout
        self.rollout, self.tokenizer, self.device = rollout, tokenizer, device
        self.limit, self.max_turns, self.max_calls = cfg.max_new_tokens, cfg.max_turns, cfg.max_tool_calls
        self.tool_timeout_s = cfg.tool_timeout_s
        self.max_seq_len = recipe.data.max_seq_len
        self.tools = [import_function(t, f"rollout.tools[{i}]") for i, t in enumerate(cfg.tools)]
        self.envs = load_environments(cfg.environment)
        for i, fn in enumerate(self.tools):
            _check_schema(fn, f"rollout.tools[{i}]")
        for name, methods in (self.envs.methods if self.envs else {}).items():
            for m in methods:
                _check_schema(getattr(self.envs.pool[name][0], m), f"rollout.environment ({m})")  # type: ignore[union-attr]
        first = next(iter(self.envs.factories)) if self.envs else None
        probe = self.envs.pool[first][0] if self.envs else None
        self.format = CallFormat(tokenizer, list(self._toolbox(probe, first).values()))
        self.budget = text_budget(tokenizer, self.limit)  # characters of a tool result the tokenizer sees

    @property
    def reward_columns(self) -> list[str]:
        """The environments' reward columns (``get_reward``), by class name."""
        return list(self.envs.rewarded) if self.envs else []

    @property
    def sync_s(self) -> float:
        return self.rollout.sync_s

    def close(self) -> None:
        self.rollout.close()

    def complete(self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False) -> list[Episode]:
        return self.complete_scored(prompts, generation, dp_rank, greedy, logprobs=False)[0]

    def complete_scored(
        self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False, logprobs: bool = True
    ) -> tuple[list[Episode], list[list[float]]]:
        going = [self._begin(p, slot) for slot, p in enumerate(prompts)]
        how = self.rollout.sampling(generation, dp_rank, greedy=greedy, logprobs=logprobs, phases=True)
        generator = self.rollout.generator
        draw = generator.sample if logprobs else None
        turn = 0
        while True:
            active = [g for g in going if not g.done]
            most = int(all_reduce_max([float(len(active))], self.device)[0])
            if most == 0:
                break
            rows = [g.prompt_ids + g.ids for g in active]
            # every rank makes as many generate() calls as the busiest one (each call's forwards and stop
            # vote are collective): a rank with fewer episodes going draws discarded rows to match
            rows += [going[0].prompt_ids] * (rows_in_step(len(rows), most, how.batch_size) - len(rows))
            longest = max((self.limit - len(g.ids) for g in active), default=1)
            this = replace(
                how,
                max_new_tokens=longest,
                seed=None if how.seed is None else (how.seed + 1_000_033 * turn) % (2**63 - 1),
                fresh=turn == 0,
                release=False,
                what=f"generation (turn {turn + 1})",
            )
            if draw is not None:
                drawn, scored = draw(rows, this)
            else:
                drawn, scored = generator.generate(rows, this), []
            for k, g in enumerate(active):
                self._turn(g, drawn[k], scored[k] if scored else None)
            turn += 1
        release = getattr(generator, "release", None)
        if release is not None:
            release()
        rewarded = self.reward_columns
        return [g.episode(rewarded) for g in going], [g.logps for g in going]

    # --- one episode -------------------------------------------------------------------------------

    def _toolbox(self, env: Any, name: str | None) -> dict[str, Callable[..., Any]]:
        """An episode's tools by name: ``rollout.tools``, then its environment's methods."""
        methods = self.envs.methods[name] if self.envs is not None and env is not None else []
        return {fn.__name__: fn for fn in self.tools} | {m: getattr(env, m) for m in methods}

    def _begin(self, prompt: Prompt, slot: int) -> Going:
        """An episode's start: its environment reset, its prompt rendered with the tools."""
        record = prompt.record
        messages = record.get("prompt")
        if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)):
            raise UserError(
                Problem(
                    "rollout.tools" if self.tools else "rollout.environment",
                    f"is set, but the prompt {_shown(prompt)} is not messages",
                    'Give prompts as messages ({"prompt": [{"role": "user", "content": ...}]}): episodes are chats.',
                )
            )
        messages = [dict(m) for m in messages]
        env, name = None, None
        if self.envs is not None:
            if None not in self.envs.factories:
                name = record.get("environment")
                if name not in self.envs.factories:
                    raise UserError(
                        Problem(
                            "rollout.environment",
                            f"has no environment {name!r}, which the record of the prompt {_shown(prompt)} names",
                            f"Give each record an environment field naming one of {', '.join(map(str, self.envs.factories))}.",
                        )
                    )
            env = self.envs.instance(name, slot)
            fields = {k: v for k, v in record.items() if not (name is not None and k == "environment")}
            try:
                observation = env.reset(**fields)
            except Exception as e:
                raise UserError(
                    Problem(
                        f"rollout.environment ({type(env).__name__}.reset)",
                        f"raised {type(e).__name__}: {e} for the record of the prompt {_shown(prompt)}",
                        "Fix reset, or the record.",
                    )
                ) from e
            if observation is not None:
                messages[-1] = {**messages[-1], "content": (messages[-1].get("content") or "") + str(observation)}
        tools = self._toolbox(env, name)
        schemas = list(tools.values())
        try:
            text = render(self.tokenizer, messages, True, schemas or None)
        except ValueError as e:
            raise UserError(Problem("rollout.tools", f"the prompt {_shown(prompt)}: {e}", TEMPLATE_FIX)) from e
        ids = self.tokenizer([text], add_special_tokens=False)["input_ids"][0]
        room = self.max_seq_len - self.limit if isinstance(self.max_seq_len, int) else None
        if room is not None and len(ids) > room:
            raise UserError(
                Problem(
                    "data.max_seq_len",
                    f"leaves {room} tokens for a prompt after rollout.max_new_tokens={self.limit}, but the prompt "
                    f"{_shown(prompt)} with its tools' schemas is {len(ids)} tokens",
                    "Raise data.max_seq_len, lower rollout.max_new_tokens, or give fewer tools.",
                )
            )
        return Going(prompt, list(ids), messages, len(messages), tools, schemas, env)

    def _turn(self, g: Going, drawn: list[int], scored: list[float] | None) -> None:
        """One drawn turn into its episode: its tokens, its message, the tools it calls, the context."""
        room = self.limit - len(g.ids)
        ids = end_at_eos(list(drawn), self.rollout.eos, room)
        ended = bool(ids) and ids[-1] in self.rollout.eos
        prefix = g.prompt_ids + g.ids
        g.ids += ids
        g.policy += [True] * len(ids)
        if scored is not None:
            g.logps += list(scored[: len(ids)])
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        content, calls, bad = self.format.read(ids, prefix, text, g.schemas)
        g.parse_failures += bad
        message: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
        if calls:
            message["tool_calls"] = calls
        g.messages.append(message)
        turns = sum(m["role"] == "assistant" for m in g.messages[g.start :])
        over = self.max_calls is not None and g.calls + len(calls) > self.max_calls
        if not ended or not calls or turns >= self.max_turns or over:
            g.done = True
            return
        g.calls += len(calls)
        results = []
        for call in calls:
            watchdog.phase(f"running the tool {call['function']['name']} (turn {turns} of an episode)")
            content, failed, late = run_call(g.tools, call, self.tool_timeout_s)
            g.tool_failures += failed
            if late:  # the tool is still running: its episode ends here, its environment is not used again
                log.warning("rollout.tool_timeout_s: %s; the episode ends at this turn", json.loads(content)["error"])
                if g.env is not None and self.envs is not None:
                    self.envs.replace(g.env)
                g.done = True
                return
            results.append({"role": "tool", "name": call["function"]["name"], "content": content[: self.budget]})
        messages = g.messages + results
        turn = len(g.messages) - 1
        try:
            context = context_ids(self.tokenizer, messages, turn, g.schemas or None)
        except ValueError as e:
            raise UserError(
                Problem("rollout.tools", f"an episode of the prompt {_shown(g.prompt)}: {e}", TEMPLATE_FIX)
            ) from e
        if len(g.ids) + len(context) >= self.limit:  # no room for a token of the next turn: the episode ends
            g.done = True
            return
        g.messages = messages
        g.ids += context
        g.policy += [False] * len(context)


def _check_schema(fn: Callable[..., Any], key: str) -> None:
    """A tool's schema as transformers makes it from its hints and docstring (what the template gets)."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(fn)
    except Exception as e:
        raise UserError(
            Problem(
                key,
                f"{getattr(fn, '__name__', fn)} has no schema transformers can read ({type(e).__name__}: {e})",
                "Give it type hints for every argument and a Google-style docstring with an Args: section naming each.",
            )
        ) from e


def rows_in_step(rows: int, most: int, batch_size: int | None) -> int:
    """How many rows a rank with ``rows`` episodes going generates so that it makes as many calls of
    ``batch_size`` rows (all at once: None) as the rank with the most, ``most``: at least one row."""
    if batch_size is None:
        return max(rows, 1)
    calls = -(-most // batch_size)
    return max(rows, (calls - 1) * batch_size + 1)
