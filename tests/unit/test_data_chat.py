"""Chat masking in one render per conversation gives the masks of the prefix-render definition; tool roles,
chat_template overrides and multimodal refusals."""

import json
import random

import pytest

from llmft.data import build_data
from llmft.data.encode import IGNORE_INDEX, Encoder
from llmft.data.records import BadRecord, parse_record
from llmft.data.tokenizer import BUILTIN_TEMPLATES, byte_tokenizer
from llmft.errors import UserError
from llmft.recipe.schema import Recipe

FOREIGN = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
# Renders the last assistant turn differently from earlier ones (like reasoning templates do).
POSITIONAL = (
    "{% for m in messages %}<{{ m['role'] }}>{% if loop.last and m['role'] == 'assistant' %}[final]{% endif %}"
    "{{ m['content'] }}</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
TEMPLATES = {"byte": None, "foreign": FOREIGN, "positional": POSITIONAL, **BUILTIN_TEMPLATES}


def conversation(rng: random.Random, turns: int, system: bool, spaces: bool = False) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "é", "中"]
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for t in range(turns):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        if spaces and rng.random() < 0.5:
            text = f"  {text} "
        msgs.append({"role": "user" if t % 2 == 0 else "assistant", "content": text})
    return {"messages": msgs}


def tokenizer(template: str | None):
    tok = byte_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_one_render_masks_equal_the_prefix_render_masks(name):
    """Random 2-12 turn conversations: the linear path gives exactly the masks of the definition."""
    rng = random.Random(0)
    tok = tokenizer(TEMPLATES[name])
    fast, reference = Encoder(tok, "completion"), Encoder(tok, "completion")
    for _ in range(40):
        chat = parse_record(conversation(rng, rng.randint(1, 6) * 2, rng.random() < 0.5, spaces=name == "llama3"))
        full = tok.apply_chat_template(chat.as_dicts(), tokenize=False)
        assert outcome(fast.assistant_spans, chat, full) == outcome(reference._prefix_spans, chat, full)
    # Whitespace that llama3's `| trim` removes takes the exact fallback, and so does every conversation
    # of a template that renders no prefix as a prefix (it fails the same way); the rest the linear path.
    if name == "llama3":
        assert 0 < fast.prefix_renders < 40
    elif name == "positional":  # prefix-consistent only with one assistant turn
        assert 0 < fast.prefix_renders < 40
    else:
        assert fast.prefix_renders == 0


def outcome(fn, chat, full):
    try:
        return fn(chat, full)
    except BadRecord as e:
        return str(e)


def test_linear_path_renders_once_per_conversation(monkeypatch):
    """12 turns cost one render (after the per-layout probe), not two per assistant turn."""
    tok = byte_tokenizer()
    enc = Encoder(tok, "completion")
    rng = random.Random(1)
    chats = [parse_record(conversation(rng, 12, False)) for _ in range(5)]
    enc.encode(chats[0])  # learns the layout of 12 alternating turns
    calls = []
    real = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: calls.append(1) or real(*a, **k))
    for chat in chats[1:]:
        enc.encode(chat)
    assert len(calls) == 4


def test_tool_calls_and_tool_results(tmp_path):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    record = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is 4."},
        ]
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(record) + "\n")
    tok = byte_tokenizer()
    r = Recipe()
    r.data.train, r.data.max_seq_len = str(path), 512
    row = build_data(r, tok).train[0]
    targets = tok.decode([t for t in row["labels"][1:] if t != IGNORE_INDEX])
    assert targets == json.dumps([call], separators=(", ", ": ")) + "<eos>It is 4.<eos>"
    assert "<|tool|>\n4<|end|>" in tok.decode(row["input_ids"])


@pytest.mark.parametrize(
    "content, why",
    [
        (
            [{"type": "text", "text": "what is"}, {"type": "image", "url": "x.png"}],
            "messages[0].content[1] is a 'image' part: multimodal content is not supported (llmft trains text-only "
            "models); keep only text parts, or write content as a string",
        ),
        ("see <image>", None),
    ],
)
def test_multimodal_content_is_refused_with_the_part(tmp_path, content, why):
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a cat"}]}
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(record) + "\n")
    r = Recipe()
    r.data.train = str(path)
    if why is None:
        assert len(build_data(r, byte_tokenizer()).train) == 1
        return
    with pytest.raises(UserError) as e:
        build_data(r, byte_tokenizer())
    assert (
        str(e.value)
        == f"{path}:1: {why}. Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
    )


def test_text_parts_are_joined(tmp_path):
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "c"}]}  # fmt: skip
    chat = parse_record(record)
    assert chat.messages[0].content == "ab"


def test_chat_template_builtin_and_file(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    r = Recipe()
    r.data.train, r.data.chat_template = str(path), "chatml"
    tok = byte_tokenizer()
    row = build_data(r, tok).train[0]
    assert tok.chat_template == BUILTIN_TEMPLATES["chatml"]  # the tokenizer carries it into checkpoints
    assert tok.decode(row["input_ids"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert tok.decode([t for t in row["labels"][1:] if t != IGNORE_INDEX]) == "yo<|im_end|>\n"
    template = tmp_path / "t.jinja"
    template.write_text(FOREIGN)
    r.data.chat_template = str(template)
    tok = byte_tokenizer()
    assert tok.decode(build_data(r, tok).train[0]["input_ids"]) == "### user:\nhi\n\n### assistant:\nyo\n\n"


def test_unknown_chat_template_suggests_a_builtin(tmp_path):
    r = Recipe()
    r.data.train, r.data.chat_template = str(tmp_path), "chatlm"
    with pytest.raises(UserError) as e:
        build_data(r, byte_tokenizer())
    assert str(e.value) == (
        "data.chat_template: 'chatlm' is neither a file nor a built-in template (llmft, chatml, llama3). "
        "Did you mean 'chatml'? Give the path of a Jinja template file, or one of the built-in names."
    )
