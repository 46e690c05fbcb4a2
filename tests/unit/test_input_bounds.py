"""Every text input is bounded (``llmft.limits``, "nesting and text"): a recipe, an override, a
training record, a prompt record and a ``rollout.file`` line nested thousands of levels deep, not
UTF-8, too long, or holding more completions than G is refused with file:line (or the override),
the limit and the fix; never a traceback. A 50 MB completion or prompt is cut to the character
budget of its token limit before it is tokenized: memory stays that of a short one, and the ids
(and the refusal of a prompt longer than its room) are exactly those of the uncut text."""

from __future__ import annotations

import json
import random

import pytest
from helpers import TINY_RECIPE, data_recipe, write_jsonl
from test_data_record_bound import bpe_tokenizer, text_of

from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.recipe.load import load_recipe
from llmft.recipe.schema import Recipe

DEEP = 3000  # levels: past Python's recursion limit, as the probes nested them
TOKENIZERS = {"byte": byte_tokenizer, "bpe": bpe_tokenizer}


def cli_error(capsys, *argv: str) -> str:
    from llmft.cli import main

    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith(f"llmft {argv[0]}: error: ")
    return err


def user_error(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    return str(e.value)


# --- recipes and overrides ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["[" * DEEP + "]" * DEEP, "{a: " * DEEP + "1" + "}" * DEEP], ids=["lists", "mappings"]
)
def test_a_recipe_nested_3000_levels_is_refused_at_its_line(capsys, tmp_path, value):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY_RECIPE + f"model_extra:\n  x: {value}\n")
    err = cli_error(capsys, "compile", str(recipe), "--out", str(tmp_path / "out"))
    line = TINY_RECIPE.count("\n") + 2
    assert f"{recipe}:{line}:" in err and ": nests mappings and lists more than 32 levels deep" in err, err
    assert "remove the extra brackets or indentation" in err
    assert not (tmp_path / "out").exists()


def test_a_recipe_nested_in_blocks_is_refused_and_one_at_the_limit_loads(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    indented = "".join("  " * (i + 2) + f"k{i}:\n" for i in range(40))
    recipe.write_text(TINY_RECIPE.replace("  dtype: fp32\n", "  dtype: fp32\n  config_extra:\n" + indented))
    msg = user_error(load_recipe, recipe)
    assert f"{recipe}:38:" in msg and "more than 32 levels deep" in msg, msg  # the 33rd level's line
    # 32 levels (model: config: x: + 29 lists) are a recipe like any other: no nesting complaint.
    text = TINY_RECIPE.replace("vocab_size: 320}", "vocab_size: 320, x: " + "[" * 29 + "]" * 29 + "}")
    recipe.write_text(text)
    assert json.dumps(load_recipe(recipe).model.config["x"]) == "[" * 29 + "]" * 29


@pytest.mark.parametrize("levels", [300, DEEP])
def test_an_override_nested_too_deep_is_refused(tmp_path, levels):
    item = "model.config.x=" + "[" * levels + "]" * levels
    msg = user_error(load_recipe, None, [item])
    assert "nests mappings and lists more than 32 levels deep (its key counts 3)" in msg, msg[-300:]


def test_a_recipe_larger_than_the_limit_is_refused_before_it_is_parsed(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY_RECIPE + "# " + "x" * (4 << 20) + "\n")
    msg = user_error(load_recipe, recipe)
    assert msg == f"{recipe}: is larger than the 4 MiB a recipe may be. Check that this is the recipe file; a " \
        "recipe is a few KB of YAML."  # fmt: skip


# --- training records ----------------------------------------------------------------------


def deep_record(levels: int = DEEP) -> str:
    return '{"text": "hi", "x": ' + "[" * levels + "]" * levels + "}"


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_training_line_nested_3000_levels_is_one_bad_record(tmp_path, objective):
    path = tmp_path / "d.jsonl"
    field = "text" if objective == "sft" else "prompt"
    path.write_text(json.dumps({field: "hello"}) + "\n" + deep_record().replace('"text"', f'"{field}"') + "\n")
    r = data_recipe(tmp_path, str(path))
    r.train.objective, r.rollout.max_new_tokens = objective, 16
    msg = user_error(build_data, r, byte_tokenizer())
    assert f"{path}:2: nests objects and lists more than 100 levels deep (llmft.limits.RECORD_MAX_DEPTH)" in msg
    assert "data.on_bad_record=skip" in msg
    r.data.on_bad_record = "skip"
    assert build_data(r, byte_tokenizer()).stats["skipped"] == 1


def test_a_json_file_record_nested_too_deep_is_one_bad_record_and_a_deep_file_is_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("[" + json.dumps({"text": "hello"}) + ", " + deep_record(150) + "]")
    msg = user_error(build_data, data_recipe(tmp_path, str(path)), byte_tokenizer())
    assert f"{path}: record 1: nests objects and lists more than 100 levels deep" in msg, msg
    path.write_text("[" + deep_record() + "]")
    msg = user_error(build_data, data_recipe(tmp_path, str(path)), byte_tokenizer())
    assert msg.startswith(f"{path}: nests objects and lists more than 100 levels deep"), msg


def test_a_line_longer_than_a_record_may_be_is_one_bad_record_never_parsed(tmp_path, monkeypatch):
    from llmft.data import read

    monkeypatch.setattr(read, "RECORD_MAX_BYTES", 1000)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a" * 900}, {"text": "b" * 1200}, {"text": "c"}])
    msg = user_error(build_data, data_recipe(tmp_path, str(path)), byte_tokenizer())
    assert f"{path}:2: is 1212 bytes, more than the 1000 bytes one record may be" in msg, msg
    json_file = tmp_path / "d.json"
    json_file.write_text(json.dumps([{"text": "a" * 900}, {"text": "b" * 1200}]))
    msg = user_error(build_data, data_recipe(tmp_path, str(json_file)), byte_tokenizer())
    assert f"{json_file}: record 1: is 1212 bytes" in msg, msg
    monkeypatch.setattr(read, "JSON_FILE_MAX_BYTES", 1000)
    msg = user_error(build_data, data_recipe(tmp_path, str(json_file)), byte_tokenizer())
    assert f"{json_file}: is {json_file.stat().st_size} bytes, more than the 1000 bytes a .json data file" in msg
    assert "jq -c '.[]' d.json > d.jsonl" in msg


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_lone_surrogate_escape_is_one_bad_record(tmp_path, objective):
    """JSON may escape half of a UTF-16 pair alone; the tokenizer cannot take the string it makes."""
    path = tmp_path / "d.jsonl"
    field = "text" if objective == "sft" else "prompt"
    path.write_text(f'{{"{field}": "pair \\ud83d\\ude00 ok"}}\n{{"{field}": "a\\ud800b"}}\n')
    r = data_recipe(tmp_path, str(path))
    r.train.objective, r.rollout.max_new_tokens = objective, 16
    msg = user_error(build_data, r, byte_tokenizer())
    assert f"{path}:2: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair)" in msg, msg
    r.data.on_bad_record = "skip"
    assert build_data(r, byte_tokenizer()).stats["skipped"] == 1  # the pair is a character: kept


# --- rollout.file ----------------------------------------------------------------------------


def rollout_error(path, G: int = 2) -> str:
    from llmft.objectives.rollout import read_rollout_file

    return user_error(read_rollout_file, str(path), G)


def test_a_rollout_line_nested_3000_levels_is_refused_at_its_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "a", "completions": ["x", "y"]}\n{"prompt": "b", "completions": ["x", "y"], "z": '
                    + "[" * DEEP + "]" * DEEP + "}\n")  # fmt: skip
    msg = rollout_error(path)
    assert f"{path}:2: nests objects and lists more than 100 levels deep" in msg, msg


def test_a_rollout_file_that_is_not_utf8_names_line_and_byte(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"prompt": "a", "completions": ["x", "y"]}\n{"prompt": "b\xff", "completions": ["x", "y"]}\n')
    msg = rollout_error(path)
    assert f"{path}:2: not valid UTF-8 (invalid start byte at byte 13). Save the file as UTF-8" in msg, msg


def test_a_rollout_completion_with_a_lone_surrogate_is_refused_at_its_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "a", "completions": ["x", "y"]}\n{"prompt": "b", "completions": ["x", "\\udc00"]}\n')
    assert f"{path}:2: holds a lone UTF-16 surrogate" in rollout_error(path)


def test_a_rollout_line_with_more_completions_than_g_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "completions": ["x", "y"]},
                                              {"prompt": "b", "completions": ["x", "y", "z"]}])  # fmt: skip
    msg = rollout_error(path)
    assert f"{path}:2: has 3 completions, more than rollout.num_generations=2" in msg, msg
    assert "Give exactly 2 completions per prompt (drop the extra ones), or set rollout.num_generations=3" in msg


def test_a_rollout_prompt_given_twice_with_other_completions_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "completions": ["x", "y"]},
                                              {"prompt": "a", "completions": ["x", "y"]},
                                              {"prompt": "a", "completions": ["x", "z"]}])  # fmt: skip
    assert f"{path}:3: gives the prompt of line 1 again, with other completions" in rollout_error(path)


def test_a_rollout_line_longer_than_a_record_is_skipped_unread(tmp_path, monkeypatch):
    from llmft.data import read

    monkeypatch.setattr(read, "RECORD_MAX_BYTES", 100)
    line = {"prompt": "a", "completions": ["x", "y" * 200]}
    msg = rollout_error(write_jsonl(tmp_path / "r.jsonl", [line]))
    assert f"r.jsonl:1: is {len(json.dumps(line))} bytes, more than the 100 bytes one record may be" in msg, msg
    assert "Shorten its completions: only the first rollout.max_new_tokens tokens of each are trained on." in msg


def file_rollout(path, tok, G: int, limit: int):
    from llmft.objectives.rollout import FileRollout

    r = Recipe()
    r.rollout.backend, r.rollout.file, r.rollout.num_generations, r.rollout.max_new_tokens = "file", str(path), G, limit
    return FileRollout(r, tok)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_cut_completion_gives_the_ids_of_the_whole_one(tmp_path, name):
    """Completions around the budget and far past it: the ids are those of the whole text, cut to
    max_new_tokens, with eos where the whole text ended within it."""
    from llmft.objectives.rollout import Prompt

    tok, limit = TOKENIZERS[name](), 16
    rollout = file_rollout(write_jsonl(tmp_path / "r.jsonl", [{"prompt": "p", "completions": ["x"]}]), tok, 1, limit)
    rng = random.Random(4)
    budget = rollout.budget
    texts = [text_of(rng, n) for n in (0, 3, limit, budget - 1, budget, budget + 1, budget + 40, 10 * budget)]
    texts += ["a" * (budget + 1), "a" * (10 * budget)]
    rollout.table = {json.dumps("p"): texts}
    rollout.G = len(texts)
    seen, real = [], rollout._ids
    rollout._ids = lambda batch: seen.extend(map(len, batch)) or real(batch)
    got = rollout.complete([Prompt(None, {"prompt": "p"}, q) for q in range(len(texts))], 0, 0)
    eos = tok.eos_token_id
    for text, ids in zip(texts, got, strict=True):
        whole = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == whole[:limit] + ([eos] if len(whole) < limit else []), len(text)
    assert max(seen) == budget  # the tokenizer never saw more than the budget


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_cut_prompt_is_kept_or_refused_as_the_whole_one(name):
    """String and chat prompts around the budget of the room and far past it: the ids of a kept
    prompt are the whole prompt's, and a prompt is refused exactly when the whole one is too long."""
    from llmft.data.encode import Encoder, text_budget
    from llmft.data.kinds.prompts import PromptEncoder, PromptRecord
    from llmft.data.records import parse_chat

    tok, room = TOKENIZERS[name](), 24
    enc = PromptEncoder(tok, room, room + 8)
    budget = text_budget(tok, room)
    rng = random.Random(5)
    prompts: list = []
    for n in (1, room - 2, room - 1, room, room + 1, budget - 1, budget, budget + 1, 10 * budget):
        prompts += [text_of(rng, n), "a" * max(n, 1)]
        prompts.append(parse_chat([{"role": "user", "content": text_of(rng, max(n - 20, 1))}]))
    seen, real = [], enc.encoder._ids_batch
    enc.encoder._ids_batch = lambda batch, special: seen.extend(map(len, batch)) or real(batch, special)
    got = enc.encode_batch([PromptRecord(p, b"{}") for p in prompts])
    assert max(seen) == budget  # the tokenizer never saw more than the budget
    whole = Encoder(tok, "all").prompt_ids_batch(prompts)
    kept = 0
    for p, g, w in zip(prompts, got, whole, strict=True):
        if len(w) > room:
            assert "that leave room for the completion" in str(g), p
        else:
            assert g.input_ids.tolist() == w.tolist(), p
            kept += 1
    assert 0 < kept < len(prompts)


def test_the_limits_live_in_one_place():
    """encode.py's cut margin and call size are the ones in llmft.limits, not copies."""
    from llmft import limits
    from llmft.data import encode, read

    assert encode.CUT_MARGIN is limits.CUT_MARGIN and encode.CALL_CHARS is limits.CALL_CHARS
    assert read.RECORD_MAX_BYTES == limits.RECORD_MAX_BYTES == 64 << 20
    assert limits.RECORD_MAX_DEPTH == 100 and limits.RECIPE_MAX_DEPTH == 32
