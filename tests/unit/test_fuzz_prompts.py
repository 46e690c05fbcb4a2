"""A fuzzing harness over the RL text inputs (hypothesis): prompt records (``train.objective:
grpo``, read by ``build_data``) and ``rollout.file`` lines (``read_rollout_file`` and
``FileRollout.complete``).

Each example writes a JSONL file of random lines: JSON of any shape and depth (up to thousands of
levels, past Python's recursion limit), wrong types where a prompt, a message or a completion
should be, prompts as text or as messages, lists of completions of any length, long texts, bytes
that are not UTF-8 spliced in, blank and random lines; token-id lines as a live run saves its
episodes (``completion_ids`` with ``policy_masks``, ``prompt_ids``, ``episodes``), whole or with a
key replaced by anything. The property, for every example:

- the file is accepted (a prompt record: built into rows that fit the room; a rollout line: each
  completion comes back as at most ``max_new_tokens`` ids, plus eos), or refused with a
  ``UserError`` naming ``file:line`` of a line of the file; never another exception (a traceback);
- within ``EXAMPLE_SECONDS`` (SIGALRM: a hang fails the example instead of the suite).

The default suite runs ``FAST_EXAMPLES`` derandomized examples per path; ``-m slow`` runs
``SLOW_EXAMPLES`` freshly drawn ones.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.recipe.schema import Recipe

FAST_EXAMPLES = 40
SLOW_EXAMPLES = 400
EXAMPLE_SECONDS = 60
G, MAX_NEW = 3, 8

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)  # fmt: skip
TEXT = st.one_of(st.text(max_size=40), st.text(alphabet="ab \n", min_size=200, max_size=3000))
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "function", "narrator", 3])
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLES, "content": st.one_of(TEXT, JSON)}),
    st.fixed_dictionaries({"role": ROLES}, optional={"content": JSON, "tool_calls": JSON, "name": JSON}),
    JSON,
)
PROMPT = st.one_of(TEXT, st.lists(MESSAGE, max_size=4), JSON)


@st.composite
def deep(draw) -> object:
    """A value nested 1 to 3000 levels (lists or objects), as JSON text would hold it."""
    levels = draw(st.sampled_from([1, 5, 99, 100, 101, 150, 999, 1000, 3000]))
    value: object = draw(SCALARS)
    as_dict = draw(st.booleans())
    for _ in range(levels):
        value = {"a": value} if as_dict else [value]
    return value


def _dumps(value: object) -> bytes:
    """JSON text of ``value``, which may be nested deeper than ``json.dumps`` recurses."""
    head, tail, v = [], [], value
    while isinstance(v, (list, dict)) and v:  # the single-child chains ``deep`` builds: a loop
        if isinstance(v, list) and len(v) == 1:
            head.append("[")
            tail.append("]")
            v = v[0]
        elif isinstance(v, dict) and list(v) == ["a"]:
            head.append('{"a": ')
            tail.append("}")
            v = v["a"]
        else:
            break
    return ("".join(head) + json.dumps(v) + "".join(reversed(tail))).encode()


@st.composite
def line(draw, record: st.SearchStrategy, good: st.SearchStrategy) -> bytes:
    kind = draw(st.sampled_from(["good", "good", "good", "record", "record", "deep", "bytes", "blank", "json"]))
    if kind in ("good", "record"):
        data = json.dumps(draw(good if kind == "good" else record)).encode()
    elif kind == "deep":  # the deep value as the prompt, a message, a completion or an extra field
        text = _dumps(draw(deep()))
        at = draw(st.sampled_from(["prompt", "completions", "extra", "whole"]))
        fields = {k: v for k, v in {"prompt": "p", "completions": ["a", "b", "c"]}.items() if k != at}
        data = text if at == "whole" else json.dumps(fields)[:-1].encode() + f', "{at}": '.encode() + text + b"}"
    elif kind == "bytes":  # bytes that are not UTF-8 (or a BOM) spliced into a good line
        good = json.dumps(draw(record)).encode()
        at = draw(st.integers(0, len(good)))
        data = (
            good[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xef\xbb\xbf", b"\x00"])) + good[at:]
        )
    elif kind == "blank":
        data = draw(st.sampled_from([b"", b"   ", b"\t"]))
    else:
        data = draw(st.binary(max_size=40))
    return data.replace(b"\n", b" ")


GOOD_PROMPT = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=30)}, optional={"answer": JSON}),
    st.fixed_dictionaries({"prompt": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                                              min_size=1, max_size=2)}),
)  # fmt: skip
IDS = st.lists(st.integers(0, 255), max_size=6)


@st.composite
def saved_episodes(draw) -> dict:
    """A ``completion_ids`` line as ``rollout.save_completions`` writes a live run's episodes: each
    completion's policy mask (one 0/1 per token), and maybe its rendered prompt and its messages."""
    ids = draw(st.lists(IDS, min_size=G, max_size=G))
    line = {"prompt": draw(st.text(max_size=20)), "completion_ids": ids}
    line["policy_masks"] = [draw(st.lists(st.sampled_from([0, 1]), min_size=len(r), max_size=len(r))) for r in ids]
    if draw(st.booleans()):
        line["prompt_ids"] = draw(
            st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=6), min_size=G, max_size=G)
        )
    if draw(st.booleans()):
        turn = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.text(max_size=10)})
        line["episodes"] = draw(st.lists(st.lists(turn, min_size=1, max_size=2), min_size=G, max_size=G))
    return line


@st.composite
def damaged_episodes(draw) -> dict:
    """A saved-episodes line with one of its keys replaced by anything."""
    line = draw(saved_episodes())
    key = draw(st.sampled_from(["policy_masks", "prompt_ids", "episodes", "completion_ids"]))
    line[key] = draw(st.one_of(JSON, st.lists(st.one_of(JSON, st.lists(MESSAGE, max_size=2), IDS), max_size=G + 1)))
    if draw(st.booleans()):
        line.pop("policy_masks")
    return line


GOOD_ROLLOUT = st.one_of(
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=20), JSON), "completions": st.lists(TEXT, min_size=G, max_size=G)}
    ),
    saved_episodes(),
)
PROMPT_RECORD = st.one_of(
    st.fixed_dictionaries({"prompt": PROMPT}, optional={"answer": JSON, "id": JSON}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}),
    JSON,
)
ROLLOUT_RECORD = st.one_of(
    st.fixed_dictionaries(
        {"prompt": PROMPT, "completions": st.lists(st.one_of(TEXT, TEXT, JSON), min_size=0, max_size=6)}
    ),
    st.fixed_dictionaries({"prompt": st.text(max_size=20), "completions": st.lists(TEXT, min_size=G, max_size=G)}),
    st.fixed_dictionaries({"prompt": PROMPT}, optional={"completions": JSON}),
    damaged_episodes(),
    JSON,
)


class _Hang(Exception):
    pass


def _raise_hang(signum, frame):
    raise _Hang(f"an example took more than {EXAMPLE_SECONDS} s")


def bounded(fn):
    """``fn()`` under SIGALRM: a hang fails the example."""
    previous = signal.signal(signal.SIGALRM, _raise_hang)
    signal.alarm(EXAMPLE_SECONDS)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def named_lines(message: str, path: Path, n: int) -> list[int]:
    """The line numbers of ``path`` that ``message`` names; at least one, each a line of the file."""
    lines = [int(k) for k in re.findall(re.escape(str(path)) + r":(\d+)", message)]
    assert lines and all(1 <= k <= n for k in lines), message
    return lines


OUTCOMES: dict[str, Counter] = {"prompts": Counter(), "rollout": Counter()}


def check_prompts(lines: list[bytes], skip: bool) -> None:
    from llmft.data.encode import IGNORE_INDEX

    work = Path(tempfile.mkdtemp(prefix="fuzz-prompts-"))
    try:
        path = work / "p.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        r = Recipe()
        r.train.objective, r.rollout.num_generations, r.rollout.max_new_tokens = "grpo", G, MAX_NEW
        r.data.train, r.data.cache_dir, r.data.max_seq_len, r.data.shuffle = str(path), str(work / "c"), 40, False
        r.data.on_bad_record = "skip" if skip else "error"
        try:
            bundle = bounded(lambda: build_data(r, byte_tokenizer()))
        except UserError as e:
            if str(e).startswith(f"data.train: '{path}' holds no "):  # blank lines only, or every record skipped
                OUTCOMES["prompts"]["no record"] += 1
                return
            named_lines(str(e), path, len(lines))
            OUTCOMES["prompts"]["refused"] += 1
            return
        for i in range(len(bundle.train)):
            item = bundle.train[i]
            assert 0 < len(item["input_ids"]) <= 40 - MAX_NEW
            assert (item["labels"] == IGNORE_INDEX).all() and "prompt" in item["record"]
        OUTCOMES["prompts"]["accepted"] += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_rollout(lines: list[bytes]) -> None:
    from llmft.objectives.rollout import FileRollout, Prompt

    work = Path(tempfile.mkdtemp(prefix="fuzz-rollout-"))
    try:
        path = work / "r.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        r = Recipe()
        r.rollout.backend, r.rollout.file, r.rollout.num_generations, r.rollout.max_new_tokens = "file", str(path), G, 8
        tok = byte_tokenizer()
        try:
            rollout = bounded(lambda: FileRollout(r, tok))
        except UserError as e:
            named_lines(str(e), path, len(lines))
            OUTCOMES["rollout"]["refused"] += 1
            return
        prompts = [Prompt(None, {"prompt": json.loads(key)}, q) for key in rollout.table for q in range(G)]
        out = bounded(lambda: rollout.complete(prompts, 0, 0))
        assert len(out) == len(prompts)
        assert all(isinstance(t, int) for ids in out for t in ids) and all(len(ids) <= MAX_NEW + 1 for ids in out)
        OUTCOMES["rollout"]["accepted"] += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
PROMPT_LINES = st.lists(line(PROMPT_RECORD, GOOD_PROMPT), min_size=1, max_size=6)
ROLLOUT_LINES = st.lists(line(ROLLOUT_RECORD, GOOD_ROLLOUT), min_size=1, max_size=6)


@settings(max_examples=FAST_EXAMPLES, derandomize=True, **_COMMON)
@given(lines=PROMPT_LINES, skip=st.booleans())
def test_fuzzed_prompt_records_are_built_or_named(lines, skip):
    check_prompts(lines, skip)


@settings(max_examples=2 * FAST_EXAMPLES, derandomize=True, **_COMMON)
@given(lines=ROLLOUT_LINES)
def test_fuzzed_rollout_files_are_read_or_named(lines):
    check_rollout(lines)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **_COMMON)
@given(lines=PROMPT_LINES, skip=st.booleans())
def test_fuzzed_prompt_records_are_built_or_named_many(lines, skip):
    check_prompts(lines, skip)


@pytest.mark.slow
@settings(max_examples=2 * SLOW_EXAMPLES, **_COMMON)
@given(lines=ROLLOUT_LINES)
def test_fuzzed_rollout_files_are_read_or_named_many(lines):
    check_rollout(lines)


def test_every_kind_of_line_once():
    """Each hostile line once, deterministically, beside the sampled examples: both outcomes happen."""
    good_prompt = json.dumps({"prompt": [{"role": "user", "content": "hi"}]}).encode()
    good_rollout = json.dumps({"prompt": "p", "completions": ["a", "bb", "c" * 5000]}).encode()
    hostile = [
        b"[" * 3000 + b"]" * 3000,
        b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b'{"prompt": "p\xff"}',
        b'{"prompt": "p", "completions": ["a", "b", "c", "d"]}',
        b'{"prompt": 3, "completions": [1, 2, 3]}',
        b'{"prompt": "p\\ud800", "completions": ["a", "\\udc00", "c"]}',
        b"\xef\xbb\xbf" + good_prompt,
    ]
    saved = {"prompt": "q", "completion_ids": [[1, 2], [3], []], "policy_masks": [[1, 0], [1], []]}
    for key, value in (("policy_masks", [[1], [1], []]), ("prompt_ids", [[], [1], [2]]), ("episodes", {"a": 1}),
                       ("episodes", ["x", [], []]), ("policy_masks", None)):  # fmt: skip
        hostile.append(json.dumps({**saved, key: value}).encode())
    hostile.append(
        json.dumps({k: v for k, v in saved.items() if k != "policy_masks"} | {"prompt_ids": [[1]] * 3}).encode()
    )
    for bad in hostile:
        check_prompts([good_prompt, bad], skip=False)
        check_rollout([good_rollout, bad])
    check_prompts([good_prompt], skip=False)
    check_rollout([good_rollout])
    before = OUTCOMES["rollout"]["accepted"]
    check_rollout([json.dumps(saved).encode()])
    assert OUTCOMES["rollout"]["accepted"] == before + 1
    assert OUTCOMES["prompts"]["accepted"] and OUTCOMES["prompts"]["refused"]
    assert OUTCOMES["rollout"]["accepted"] and OUTCOMES["rollout"]["refused"] >= len(hostile)
