"""Reading, validating, formatting and masking records (llmft.data.read/records/encode/dataset)."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import default_recipe, write_jsonl

from llmft.data import build_data
from llmft.data.encode import IGNORE_INDEX
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError

CHAT = {
    "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "six"},
    ]
}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


recipe = default_recipe


def texts(bundle, tok, split="train"):
    ds = getattr(bundle, split)
    return [tok.decode(ds[i]["input_ids"]) for i in range(len(ds))]


def targets(row, tok) -> str:
    """The target tokens of a row, decoded (labels[0] is never a target)."""
    return tok.decode([t for t in row["labels"][1:] if t != IGNORE_INDEX])


def user_error(tmp_path, tok, **data) -> str:
    with pytest.raises(UserError) as e:
        build_data(recipe(**data), tok)
    return str(e.value)


# --- formats -------------------------------------------------------------


def test_jsonl_json_parquet_and_directories_in_sorted_order(tmp_path, tok):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "b.jsonl", [{"text": "b1"}, {"text": "b2"}])
    (d / "a.json").write_text(json.dumps([{"text": "a1"}]))
    (d / "sub" / "c.json").write_text(json.dumps({"data": [{"text": "c1"}]}))
    pq.write_table(pa.Table.from_pylist([{"text": "b0"}]), d / "b.parquet")
    (d / ".hidden.jsonl").write_text('{"text": "no"}\n')
    (d / "README.md").write_text("ignored")
    bundle = build_data(recipe(d), tok)
    assert texts(bundle, tok) == [f"<bos>{t}<eos>" for t in ("a1", "b1", "b2", "b0", "c1")]
    assert bundle.stats["records"] == 5 and bundle.eval is None


def test_list_of_paths_keeps_list_order(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    assert texts(build_data(recipe([b, a]), tok), tok) == ["<bos>b<eos>", "<bos>a<eos>"]


def test_save_to_disk_directory(tmp_path, tok):
    import datasets

    datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}]).save_to_disk(
        str(tmp_path / "ds")
    )
    bundle = build_data(recipe(tmp_path / "ds"), tok)
    assert [targets(bundle.train[i], tok) for i in range(2)] == ["c<eos>", "d<eos>"]


def test_saved_dataset_dict_asks_for_a_split(tmp_path, tok):
    import datasets

    ds = datasets.Dataset.from_list([{"text": "x"}])
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    assert user_error(tmp_path, tok, train=tmp_path / "dd") == (
        f"data.train: '{tmp_path / 'dd'}' is a saved DatasetDict with splits ['test', 'train']. "
        f"Point data.train at one split's directory, e.g. {tmp_path / 'dd' / 'test'}, or give {{path, split}}."
    )


# --- targets ---------------------------------------------------------------


def test_chat_trains_on_assistant_tokens_only(tmp_path, tok):
    bundle = build_data(recipe(write_jsonl(tmp_path / "c.jsonl", [CHAT])), tok)
    row = bundle.train[0]
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert targets(row, tok) == "4<eos>six<eos>"


def test_chat_masking_with_a_foreign_template(tmp_path, tok):
    """No {% generation %} markers and multi-token role headers: spans come from rendering prefixes."""
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:\n{% endif %}"
    )
    bundle = build_data(recipe(write_jsonl(tmp_path / "c.jsonl", [CHAT])), tok)
    assert targets(bundle.train[0], tok) == "4\n\nsix\n\n"


def test_prompt_completion_masks_the_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 1+1 A:", "completion": " 2"}])
    row = build_data(recipe(path), tok).train[0]
    assert tok.decode(row["input_ids"]) == "<bos>Q: 1+1 A: 2<eos>"
    assert targets(row, tok) == " 2<eos>"


def test_train_on_all(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "Q", "completion": "A"}, CHAT])
    bundle = build_data(recipe(path, train_on="all"), tok)
    for i in range(2):
        row = bundle.train[i]
        assert row["labels"].tolist() == row["input_ids"].tolist()


def test_text_trains_on_everything_even_with_train_on_completion(tmp_path, tok):
    row = build_data(recipe(write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])), tok).train[0]
    assert row["labels"].tolist() == row["input_ids"].tolist() and targets(row, tok) == "abc<eos>"


# --- truncation, eval --------------------------------------------------------


def test_truncation_is_counted_in_one_warning(tmp_path, tok, caplog):
    records = [{"text": "x" * 50}] * 3 + [{"text": "short"}]
    with caplog.at_level(logging.WARNING, logger="llmft.data"):
        bundle = build_data(recipe(write_jsonl(tmp_path / "t.jsonl", records), max_seq_len=16), tok)
    assert bundle.stats["truncated"] == 3
    assert [len(bundle.train[i]["input_ids"]) for i in range(4)] == [16, 16, 16, 7]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["data.train: truncated 3 of 4 records to data.max_seq_len=16 tokens"]


def test_records_whose_targets_are_truncated_away_are_dropped(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "p" * 40, "completion": "c"}, {"prompt": "p", "completion": "c"}]
    )
    bundle = build_data(recipe(path, max_seq_len=16), tok)
    assert len(bundle.train) == 1 and bundle.stats["dropped_no_targets"] == 1


def test_eval_file_and_eval_prompts(tmp_path, tok):
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": "t"}])
    ev = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "Q", "completion": "A"}, CHAT, {"text": "no prompt"}])
    r = recipe(train)
    r.data.eval = str(ev)
    bundle = build_data(r, tok)
    assert len(bundle.eval) == 3
    (p1, ref1), (p2, ref2) = bundle.eval_prompts
    assert (tok.decode(p1), ref1) == ("<bos>Q", "A")
    assert tok.decode(p2) == tok.apply_chat_template(CHAT["messages"][:4], tokenize=False, add_generation_prompt=True)
    assert ref2 == "six"


def test_eval_fraction_is_a_seeded_disjoint_holdout(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"r{i}"} for i in range(20)])

    def split(seed):
        r = recipe(path, eval_fraction=0.25)
        r.run.seed = seed
        b = build_data(r, tok)
        return texts(b, tok), texts(b, tok, "eval")

    train, held = split(0)
    assert len(held) == 5 and len(train) == 15 and not set(train) & set(held)
    assert split(0) == (train, held) and split(1)[1] != held


# --- user errors ---------------------------------------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "x",}\n')
    assert user_error(tmp_path, tok, train=path) == (
        f"{path}:3: not valid JSON (Expecting property name enclosed in double quotes at column 14). "
        "Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
    )


@pytest.mark.parametrize(
    "record, why",
    [
        ({"prompt": "p"}, "has 'prompt' but no 'completion'"),
        (
            {"txt": "x"},
            "a record needs 'text', 'prompt' and 'completion', or 'messages'; found keys ['txt']"
            " (did you mean 'text' for 'txt')",
        ),
        ({"promt": "p", "completion": "c"}, "has 'completion' but no 'prompt' (did you mean 'prompt' for 'promt')"),
        ({"input": "x"}, "a record needs 'text', 'prompt' and 'completion', or 'messages'; found keys ['input']"),
        ({"text": 3}, "'text' must be a string, got a number (3)"),
        ([1], "a record must be a JSON object, got a list"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "messages[0].role 'bot' is not one of system, user, assistant, tool, function",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0] must be an object with 'role' and 'content'"),
        ({"messages": []}, "'messages' must be a non-empty list of {role, content} objects, got a list"),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            "has no assistant message, so nothing to train on (data.train_on=completion)",
        ),
    ],
)
def test_bad_record_names_line_and_reason(tmp_path, tok, record, why):
    path = write_jsonl(tmp_path / "r.jsonl", [{"text": "fine"}, record])
    assert user_error(tmp_path, tok, train=path) == (
        f"{path}:2: {why}. Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
    )


def test_bad_record_in_json_file_names_record_index(tmp_path, tok):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": None}, {"text": 1}]))
    assert user_error(tmp_path, tok, train=path).startswith(f"{path}: record 1: a record needs")


def test_skip_counts_bad_records(tmp_path, tok, caplog):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "a"}\nnot json\n{"prompt": "p"}\n{"text": "b"}\n')
    with caplog.at_level(logging.WARNING, logger="llmft.data"):
        bundle = build_data(recipe(path, on_bad_record="skip"), tok)
    assert texts(bundle, tok) == ["<bos>a<eos>", "<bos>b<eos>"]
    assert bundle.stats["skipped"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"data.train: skipped 2 malformed record(s) (data.on_bad_record=skip); the first: {path}:2: "
        "not valid JSON (Expecting value at column 1)"
    ]


def test_empty_dataset_names_the_path(tmp_path, tok):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert user_error(tmp_path, tok, train=path) == (
        f"data.train: '{path}' holds no records. Point data.train at data with at least one record."
    )
    path.write_text("oops\n")
    assert user_error(tmp_path, tok, train=path, on_bad_record="skip") == (
        f"data.train: '{path}' holds no usable (1 malformed, skipped) records. "
        "Point data.train at data with at least one record."
    )


def test_missing_path(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert user_error(tmp_path, tok, train="nope.jsonl") == (
        f"data.train: path 'nope.jsonl' does not exist. Check the path (relative to {tmp_path})."
    )


def test_directory_without_data_files(tmp_path, tok):
    (tmp_path / "notes.txt").write_text("x")
    assert user_error(tmp_path, tok, train=tmp_path) == (
        f"data.train: directory '{tmp_path}' holds no .jsonl, .json, .parquet or .csv files. Check the path."
    )
