"""Live multi-turn episodes (``llmft.objectives.agent``), driven by a scripted generator: the turns a
model would write (tool calls in the template's own format) come back as token ids, so every rule of
the episode is checked exactly: the ids and policy mask equal what ``rollout.file`` makes of the same
messages, the tools' results and errors go back to the model, environments in TRL's contract run
unchanged, and the bounds end episodes where they say."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from agent_runs import agent_recipe

from llmft.data.tokenizer import BUILTIN_TEMPLATES, byte_tokenizer
from llmft.errors import UserError
from llmft.model.generate import Generation
from llmft.objectives.agent import AgentRollout, CallFormat, call_of, rows_in_step
from llmft.objectives.episodes import Episode, episode_ids
from llmft.objectives.rollout import GeneratedRollout, Prompt
from llmft.recipe.load import load_recipe


def call(name: str, **args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def written(tok, message: dict) -> list[int]:
    """The ids the template writes for an assistant ``message``, through its eos: what a model trained
    on the template's transcripts samples."""
    user = [{"role": "user", "content": "x"}]
    before = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template([*user, message], tokenize=False)
    text = after[len(before) :]
    return tok(text[: text.index(tok.eos_token) + len(tok.eos_token)], add_special_tokens=False)["input_ids"]


class Scripted:
    """A ``Generator`` whose turn is ``script(row text)``'s message, as the template writes it, then
    padding past the eos (a batch's longer rows); records the calls it got."""

    def __init__(self, tok, script) -> None:
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, how: Generation):
        return self.sample(prompts, how)[0]

    def sample(self, prompts, how: Generation):
        self.calls.append((len(prompts), how))
        rows = [written(self.tok, self.script(self.tok.decode(list(p)))) for p in prompts]
        rows = [(r + [self.tok.pad_token_id] * 5)[: how.max_new_tokens] for r in rows]
        return rows, [[-0.5 - i for i in range(len(r))] for r in rows]


def two_turns(text: str) -> dict:
    """Call add on the two numbers of the prompt, then answer with the tool's result."""
    if "<|tool|>" in text:
        return {"role": "assistant", "content": text.rsplit("<|tool|>\n", 1)[1].split("<|end|>")[0]}
    a, b = text.split("<|user|>\n", 1)[1].split("<|end|>")[0].split(" ")[0].split("+")
    return {"role": "assistant", "content": "", "tool_calls": [call("add", a=int(a), b=int(b))]}


def rollout(tmp_path, script, **over):
    recipe = load_recipe(str(agent_recipe(tmp_path / "r", **over)), [])
    tok = byte_tokenizer()
    tok.chat_template = BUILTIN_TEMPLATES["llmft"]
    generator = Scripted(tok, script)
    base = GeneratedRollout(recipe, generator, {tok.eos_token_id})
    return AgentRollout(recipe, base, tok, torch.device("cpu")), generator, tok


def prompts_of(records: list[dict]) -> list[Prompt]:
    return [Prompt(torch.tensor([0]), r, q) for q, r in enumerate(records)]


RECORDS = [
    {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b), "start": a}
    for a, b in ((12, 30), (7, 5))
]


def test_a_live_episode_is_the_file_episode_of_its_messages(tmp_path, agent_tools):
    agent, generator, tok = rollout(tmp_path, two_turns)
    episodes, logps = agent.complete_scored(prompts_of(RECORDS), 0, 0)
    for record, ep, lp in zip(RECORDS, episodes, logps, strict=True):
        assert isinstance(ep, Episode)
        assert [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant"]
        assert ep.messages[1]["content"] == record["answer"]  # the tool ran: its result went back
        assert ep.text == record["answer"] and ep.turns == 2 and ep.tool_calls == 1
        again = episode_ids(tok, record["prompt"], ep.messages, 200, 10_000)
        assert list(ep) == list(again) and ep.policy == again.policy  # the tokens rollout.file makes of it
        head = tok.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
        assert ep.prompt_ids == tok(head, add_special_tokens=False)["input_ids"]
        assert len(lp) == sum(ep.policy)  # a sampler log-prob per policy token, none for context
    # two turns, every rank's rows together; the weights synced before the first only
    assert [(n, how.fresh, how.release) for n, how in generator.calls] == [(2, True, False), (2, False, False)]
    assert generator.calls[0][1].seed != generator.calls[1][1].seed


def test_a_tool_that_raises_or_is_unknown_is_told_to_the_model(tmp_path, agent_tools):
    def script(text):
        if "<|tool|>" in text:
            return {"role": "assistant", "content": "done"}
        return {"role": "assistant", "content": "", "tool_calls": [call("broken", x=3), call("nope")]}

    agent, _, _ = rollout(
        tmp_path, script, rollout__tools=["agent_tools:add", "agent_tools:broken"], rollout__max_new_tokens=380
    )
    ep = agent.complete(prompts_of(RECORDS[:1]), 0, 0)[0]
    results = [json.loads(m["content"]) for m in ep.messages if m["role"] == "tool"]
    assert results == [
        {"error": "RuntimeError: broken tool got 3"},
        {"error": "no tool named 'nope' (tools: add, broken)"},
    ]
    assert ep.tool_failures == 2 and ep.text == "done"


def test_a_tool_call_that_does_not_return_in_time_ends_its_episode(tmp_path, agent_tools):
    def calling(name):
        def script(text):
            if "<|tool|>" in text:
                return {"role": "assistant", "content": "done"}
            return {"role": "assistant", "content": "", "tool_calls": [call(name, seconds=5)]}

        return script

    late = {"rollout__tool_timeout_s": 0.2}
    agent, _, _ = rollout(tmp_path / "tool", calling("stuck"), rollout__tools=["agent_tools:stuck"], **late)
    (ep,) = agent.complete(prompts_of(RECORDS[:1]), 0, 0)
    assert any(t.name == "llmft-tool-stuck" for t in threading.enumerate())  # returned while the tool still runs
    assert [m["role"] for m in ep.messages] == ["assistant"] and ep.messages[0]["tool_calls"][0]["function"] == {
        "name": "stuck",
        "arguments": {"seconds": 5},
    }
    assert ep.tool_failures == 1 and ep.turns == 1 and ep.tool_calls == 1
    agent, _, _ = rollout(
        tmp_path / "env", calling("wait"), rollout__tools=[], rollout__environment="agent_tools:Sleepy", **late
    )
    first = agent.envs.instance(None, 0)
    (ep,) = agent.complete(prompts_of(RECORDS[:1]), 0, 0)
    assert ep.tool_failures == 1 and ep.turns == 1
    fresh = agent.envs.instance(None, 0)
    assert fresh is not first and type(fresh).__name__ == "Sleepy"  # the slot's next episodes get a new one


def test_a_call_that_does_not_parse_ends_the_episode_counted(tmp_path, agent_tools):
    agent, _, _ = rollout(
        tmp_path, lambda text: {"role": "assistant", "content": '[{"name": "add", "arguments": {"a": 1'}
    )
    ep = agent.complete(prompts_of(RECORDS[:1]), 0, 0)[0]
    assert ep.parse_failures == 1 and ep.turns == 1 and ep.tool_calls == 0 and all(ep.policy)


def test_max_turns_and_max_tool_calls_end_episodes(tmp_path, agent_tools):
    always = lambda text: {"role": "assistant", "content": "", "tool_calls": [call("add", a=1, b=2)]}  # noqa: E731
    agent, _, _ = rollout(tmp_path, always, rollout__max_turns=2)
    ep = agent.complete(prompts_of(RECORDS[:1]), 0, 0)[0]
    assert ep.turns == 2 and ep.tool_calls == 2 and ep.messages[-1]["role"] == "assistant"
    agent, _, _ = rollout(tmp_path, always, rollout__max_turns=5, rollout__max_tool_calls=1)
    ep = agent.complete(prompts_of(RECORDS[:1]), 0, 0)[0]
    assert ep.turns == 2 and [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant"]
    # the budget: a result that would leave no room for the next turn ends the episode before it
    first = len(written(byte_tokenizer(), always("")))  # the first turn; its tool result's context is 6 tokens
    agent, _, _ = rollout(tmp_path, always, rollout__max_turns=5, rollout__max_new_tokens=first + 3)
    ep = agent.complete(prompts_of(RECORDS[:1]), 0, 0)[0]
    assert len(ep) == first and ep.messages[-1]["role"] == "assistant" and ep.turns == 1


def test_a_trl_environment_runs_unchanged(tmp_path, agent_tools):
    def script(text):
        if "<|tool|>" in text:
            return {"role": "assistant", "content": "ok"}
        return {"role": "assistant", "content": "", "tool_calls": [call("increment", by=2), call("increment", by=3)]}

    agent, _, tok = rollout(tmp_path, script, rollout__tools=[], rollout__environment="agent_tools:Counter")
    assert agent.reward_columns == ["Counter"]
    episodes = agent.complete(prompts_of(RECORDS), 0, 0)
    for record, ep in zip(RECORDS, episodes, strict=True):
        start = record["start"]
        assert [m["content"] for m in ep.messages if m["role"] == "tool"] == [str(start + 2), str(start + 5)]
        assert ep.rewards == {"Counter": 2.0}  # get_reward(): the calls of its own episode
        head = tok.decode(ep.prompt_ids)
        assert f"{record['prompt'][0]['content']} (the counter starts at {start})<|end|>" in head  # reset's words


def test_an_environment_whose_reset_raises_names_the_record(tmp_path, agent_tools):
    agent, _, _ = rollout(tmp_path, two_turns, rollout__tools=[], rollout__environment="agent_tools:BadReset")
    with pytest.raises(UserError) as e:
        agent.complete(prompts_of(RECORDS[:1]), 0, 0)
    assert str(e.value.problems[0]) == (
        "rollout.environment (BadReset.reset): raised ValueError: no board for 42 for the record of the prompt "
        '[{"role": "user", "content": "12+30"}]. Fix reset, or the record.'
    )


@pytest.mark.parametrize(
    ("template", "text", "calls", "bad"),
    [
        ("chatml", 'sure <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', [call("add", a=1)], False),
        ("chatml", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call><tool_call>{"x"', [], True),
        ("llmft", 'I think [x] then [{"function": {"name": "add", "arguments": {}}}]', [call("add")], False),
        ("llmft", "the answer is 42", [], False),
        (
            "llama3",
            '{"name": "add", "arguments": {"b": 3}} {"name": "add", "arguments": {}}',
            [call("add", b=3), call("add")],
            False,
        ),
    ],
)
def test_calls_are_read_by_the_templates_convention(template, text, calls, bad):
    tok = byte_tokenizer()
    tok.chat_template = BUILTIN_TEMPLATES[template]
    fmt = CallFormat(tok, [])
    _, got, failed = fmt.parse(text)
    assert (got, failed) == (calls, bad)
    assert call_of({"name": 3}) is None


def test_a_template_that_writes_no_tool_calls_is_refused(tmp_path, agent_tools):
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(UserError) as e:
        CallFormat(tok, [])
    assert "rollout.tools: the chat template does not write an assistant's tool_calls" in str(e.value)


def test_a_rank_whose_episodes_ended_keeps_drawing_with_its_peers(tmp_path, agent_tools, monkeypatch):
    """Every rank calls the generator once per turn while any rank has an episode going (sharded
    engines join every forward; the stop vote is a collective): here a peer goes on for one turn more."""
    import llmft.objectives.agent as agent_module

    votes = []

    def peers_going(values, device):  # this rank's episodes going, and a peer's going for one turn more
        votes.append(values[0])
        return [max(values[0], 1.0)] if len(votes) <= 3 else [0.0]

    monkeypatch.setattr(agent_module, "all_reduce_max", peers_going)
    agent, generator, tok = rollout(tmp_path, two_turns)
    episodes = agent.complete(prompts_of(RECORDS), 0, 0)
    assert votes == [2.0, 2.0, 0.0, 0.0]  # both going, both going, ended (the peer goes on), all ended
    assert [n for n, _ in generator.calls] == [2, 2, 1]  # the third turn: one row, the first prompt's
    assert generator.calls[2][1].max_new_tokens == 1
    assert all(ep.turns == 2 for ep in episodes)  # the extra draw is not any episode's


def test_the_plan_refuses_what_cannot_generate_episodes(tmp_path, agent_tools):
    from llmft.plan.resolve import load_plan

    path = agent_recipe(tmp_path / "r")
    bad = [
        "rollout.backend=file",
        "rollout.file=x.jsonl",
        "rollout.tools=[agent_tools:add,agent_tools:nothing,nowhere_module:f]",
        "rollout.max_turns=0",
        "rollout.environment=[1,2]",
        "rollout.tool_timeout_s=0",
    ]
    with pytest.raises(UserError) as e:
        load_plan(path, bad, nnodes=1, nproc_per_node=1)
    text = str(e.value)
    assert (
        "rollout.tools: is set, but rollout.backend is file: a file's episodes are replayed, no tool is called" in text
    )
    assert "rollout.tools[1]: module 'agent_tools' has no function 'nothing'" in text
    assert "rollout.tools[2]: cannot import module 'nowhere_module'" in text
    assert "rollout.max_turns: is 0. Use 1 or more." in text
    assert "rollout.tool_timeout_s: is 0.0. Use seconds above 0, or null." in text
    assert "rollout.environment: is [1, 2], not a class or a mapping of names to classes" in text


def test_the_plan_and_the_card_say_what_episodes_are(tmp_path, agent_tools):
    from llmft.plan.report import plan_command

    path = agent_recipe(tmp_path / "r", rollout__environment={"count": "agent_tools:Counter"}, rewards=[])
    text = plan_command(str(path), ["rollout.max_tool_calls=4"], nnodes=1, nproc_per_node=1)
    assert (
        "episodes: tools add; environment Counter; at most 3 turns, 4 tool calls and 200 tokens each (the "
        "policy's and the tools'; only the policy's trained)"
    ) in text
    from llmft.plan.objectives import objective_spec
    from llmft.plan.rl import card_words

    words = card_words(objective_spec("grpo"), {"rollout": {"tools": ["m:f"], "environment": "m:E", "max_turns": 3}})
    assert words.endswith("; multi-turn episodes (tools m:f; environment m:E; at most 3 turns)")


def test_bad_saved_episode_lines_are_named_at_their_line(tmp_path):
    from llmft.objectives.rollout import read_rollout_file

    ids = [[1, 2, 3], [4, 5]]
    lines = [
        {"prompt": "a", "completion_ids": ids, "policy_masks": [[1, 0, 1], [1]]},
        {"prompt": "b", "completion_ids": ids, "prompt_ids": [[7], [7]]},
        {"prompt": "c", "completion_ids": ids, "policy_masks": [[1, 0, 1], [1, 1]], "prompt_ids": [[], [7]]},
        {
            "prompt": "d",
            "completion_ids": ids,
            "policy_masks": [[1, 0, 1], [1, 1]],
            "episodes": [[{"role": "tool"}], []],
        },
    ]
    path = tmp_path / "saved.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UserError) as e:
        read_rollout_file(str(path), 2)
    text = str(e.value)
    assert f"{path}:1: its policy_masks are not 2 lists of 0/1, one per token of each completion" in text
    assert f"{path}:2: gives prompt_ids or episodes without policy_masks" in text
    assert f"{path}:3: its prompt_ids are not 2 non-empty lists of token ids" in text
    assert f"{path}:4: episode 0 is not an episode:" in text
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "a", "completion_ids": ids, "policy_masks": [[1, 0, 1], [1, 1]]}) + "\n")
    (first, second) = read_rollout_file(str(good), 2)[json.dumps("a")]
    assert isinstance(first, Episode) and first.policy == [True, False, True] and first.prompt_ids is None


@pytest.mark.parametrize("template", ["llmft", "chatml"])
def test_the_context_between_turns_is_trls_tool_suffix(template):
    """The tokens after a tool-calling turn (what the template writes after its eos, the tool
    message, the next turn's header) are the ids TRL 1.16's GRPOTrainer appends after a tool call and
    masks out of its loss (``_get_tool_suffix_ids``, run on this tokenizer)."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from llmft.objectives.episodes import context_ids

    tok = byte_tokenizer()
    tok.chat_template = BUILTIN_TEMPLATES[template]
    tool = [{"role": "tool", "name": "add", "content": "42"}]
    trainer = SimpleNamespace(
        processing_class=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False, _tokenizer=tok
    )
    trl_suffix = GRPOTrainer._get_tool_suffix_ids(trainer, tool)
    messages = [
        {"role": "user", "content": "12+30"},
        {"role": "assistant", "content": "", "tool_calls": [call("add", a=12, b=30)]},
        *tool,
    ]
    assert context_ids(tok, messages, 1) == trl_suffix


def test_an_environment_reward_of_the_wrong_type_is_named(tmp_path, agent_tools):
    agent, _, _ = rollout(tmp_path, two_turns, rollout__tools=[], rollout__environment="agent_tools:WordReward")
    with pytest.raises(UserError) as e:
        agent.complete(prompts_of(RECORDS[:1]), 0, 0)
    assert str(e.value.problems[0]) == (
        "rollout.environment (WordReward.get_reward): returned 'high' (str) for the prompt "
        '[{"role": "user", "content": "12+30"}]. Return a finite float, or None (no opinion).'
    )


def test_a_records_environment_field_picks_its_class(tmp_path, agent_tools):
    def script(text):
        if "<|tool|>" in text:
            return {"role": "assistant", "content": "ok"}
        return {"role": "assistant", "content": "", "tool_calls": [call("increment", by=1)]}

    envs = {"count": "agent_tools:Counter", "words": "agent_tools:WordReward"}
    agent, _, _ = rollout(tmp_path, script, rollout__tools=[], rollout__environment=envs)
    assert agent.reward_columns == ["Counter", "WordReward"]
    records = [{**RECORDS[0], "environment": "count"}, {**RECORDS[1], "environment": "count"}]
    episodes = agent.complete(prompts_of(records), 0, 0)
    assert [ep.rewards for ep in episodes] == [{"Counter": 1.0, "WordReward": None}] * 2
    with pytest.raises(UserError) as e:
        agent.complete(prompts_of([{**RECORDS[0], "environment": "chess"}]), 0, 0)
    assert "rollout.environment: has no environment 'chess', which the record of the prompt" in str(e.value)


def test_a_tokenizer_with_a_response_template_parses_its_own_turns():
    """transformers' ``parse_response`` where the tokenizer has a response template (TRL's for the
    Qwen templates): the turn's ids read back into content and calls, arguments cast by the schema."""
    import trl
    from trl.chat_template_utils import qwen3_template

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    tok = byte_tokenizer()
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tok.response_template = qwen3_template
    fmt = CallFormat(tok, [add])
    assert fmt.kind == "transformers"
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    text = 'sure <tool_call>\n{"name": "add", "arguments": {"a": 3, "b": "4"}}\n</tool_call><|im_end|>'
    assert fmt.read(ids(text), [], text, [add]) == ("sure", [call("add", a=3, b=4)], False)
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 3\n</tool_call><|im_end|>'
    assert fmt.read(ids(broken), [], broken, [add]) == (broken, [], True)


def test_every_rank_makes_as_many_generate_calls_as_the_busiest():
    def calls(rows: int, size: int | None) -> int:
        return 1 if size is None else -(-rows // size)

    for size in (None, 1, 2, 3, 8):
        for most in range(1, 20):
            for rows in range(most + 1):
                n = rows_in_step(rows, most, size)
                assert n >= max(rows, 1) and calls(n, size) == calls(most, size), (rows, most, size, n)
                assert n == max(rows, 1) or calls(n - 1, size) < calls(most, size)  # no row more than needed
