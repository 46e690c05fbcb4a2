"""Prompt records (train.objective: grpo) through the data pipeline: records, tokens, the room for
generation, the record kept with its row, G completions per prompt, mixtures, streams, collation."""

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import default_recipe, write_jsonl

from llmft.data import MicroBatchSampler, build_data, collate, count_targets
from llmft.data.encode import IGNORE_INDEX, Encoder
from llmft.data.kinds.prompts import PromptGroups
from llmft.data.records import PromptCompletion
from llmft.data.tokenizer import byte_tokenizer
from llmft.data.tokens import TokenDataset
from llmft.errors import UserError
from llmft.plan.batch import BatchPlan
from llmft.plan.objectives import objective_problems
from llmft.recipe.schema import Recipe

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
EXTRA = {"answer": "4", "score": 0.5, "tests": ["assert f(2) == 4", 3], "meta": {"level": 2}}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def recipe(train, tmp_path: Path, group: int = 4, new: int = 16, **data) -> Recipe:
    r = default_recipe(train, "grpo", max_seq_len=data.pop("max_seq_len", 64), cache_dir=str(tmp_path / "c"), **data)
    r.rollout.num_generations, r.rollout.max_new_tokens = group, new
    return r


def questions(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"question {i}", "id": i, **EXTRA} for i in range(start, start + n)]


def error_of(r: Recipe, tok) -> str:
    with pytest.raises(UserError) as e:
        build_data(r, tok)
    return str(e.value)


# --- records and tokens ----------------------------------------------------------


def test_a_string_prompt_is_the_prompt_part_of_the_sft_record(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "reverse: abc\n", "answer": "cba"}])
    item = build_data(recipe(path, tmp_path, shuffle=False), tok).train[0]
    sft = Encoder(tok, "completion").encode(PromptCompletion("reverse: abc\n", "cba"))
    prompt_part = sft.input_ids[: int(np.argmax(sft.labels != IGNORE_INDEX))]
    assert item["input_ids"].tolist() == prompt_part.tolist()
    assert item["input_ids"][0] == tok.bos_token_id  # bos as SFT writes it
    assert (item["labels"] == IGNORE_INDEX).all()  # no targets


def test_a_messages_prompt_is_the_chat_template_with_the_generation_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": MESSAGES}])
    item = build_data(recipe(path, tmp_path), tok).train[0]
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert item["input_ids"].tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(item["input_ids"]).endswith("<|assistant|>\n")
    assert item["record"] == {"prompt": MESSAGES}


def test_fields_rename_columns_and_the_record_keeps_the_renamed_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q?", "gold": 7}])
    src = {"path": str(path), "fields": {"prompt": "question"}}
    item = build_data(recipe(src, tmp_path), tok).train[0]
    assert item["record"] == {"gold": 7, "prompt": "q?"}
    assert tok.decode(item["input_ids"]) == tok.bos_token + "q?"


@pytest.mark.parametrize(
    "record, reason",
    [
        (
            {"question": "q?"},
            "a prompt record needs 'prompt' (a string, or a list of messages); found keys ['question']",
        ),
        ({"promt": "q?"}, "(did you mean 'prompt' for 'promt')"),
        ({"messages": MESSAGES}, "fields: {prompt: messages}"),
        ({"prompt": 3}, "'prompt' must be a string or a non-empty list of messages, got a number (3)"),
        ({"prompt": ""}, "'prompt' is empty"),
        ({"prompt": [{"role": "user"}]}, "'prompt': messages[0] must be an object with 'role' and 'content'"),
        ({"prompt": [*MESSAGES, {"role": "assistant", "content": "4"}]}, "'prompt' ends with an assistant message"),
    ],
)
def test_a_bad_prompt_record_names_file_and_line(tmp_path, tok, record, reason):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, record])
    msg = error_of(recipe(path, tmp_path), tok)
    assert f"{path}:2" in msg and reason in msg, msg
    assert "data.on_bad_record=skip" in msg


def test_a_prompt_longer_than_the_room_for_generation_is_a_bad_record(tmp_path, tok):
    # max_seq_len 32 - max_new_tokens 16 leaves 16 tokens: bos + 15 bytes fit, bos + 16 do not.
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a" * 15}, {"prompt": "b" * 16}, {"prompt": "c"}])
    msg = error_of(recipe(path, tmp_path, max_seq_len=32), tok)
    assert f"{path}:2: its prompt is 17 tokens, more than the 16 that leave room for the completion" in msg, msg
    assert "(data.max_seq_len 32 - rollout.max_new_tokens 16)" in msg
    assert "shorten the prompt, raise data.max_seq_len, or lower rollout.max_new_tokens" in msg

    bundle = build_data(recipe(path, tmp_path, max_seq_len=32, on_bad_record="skip"), tok)
    assert bundle.stats["skipped"] == 1 and len(bundle.records) == 2
    assert sorted(r["prompt"] for r in map(bundle.records.record, range(2))) == ["a" * 15, "c"]
    # With more room the prompt fits: another cache entry (the key holds the room).
    roomy = build_data(recipe(path, tmp_path, max_seq_len=32, new=15), tok)
    assert len(roomy.records) == 3 and roomy.entries[0]["entry"] != bundle.entries[0]["entry"]


def test_packing_and_no_room_are_refused_at_resolve(tmp_path):
    r = recipe(tmp_path / "p.jsonl", tmp_path, packing=True, max_seq_len=16)
    problems = {p.where: p for p in objective_problems(r, lambda key: key)}
    assert "prompts, which are never packed" in problems["data.packing"].what
    assert problems["data.packing"].fix == "Set data.packing=false."
    assert "leaves no room for a prompt within data.max_seq_len=16" in problems["rollout.max_new_tokens"].what


# --- the record travels with its row ---------------------------------------------


def test_the_record_comes_back_from_the_memory_mapped_cache_entry(tmp_path, tok):
    records = questions(3)
    path = write_jsonl(tmp_path / "p.jsonl", records)
    first = build_data(recipe(path, tmp_path, shuffle=False), tok)
    again = build_data(recipe(path, tmp_path, shuffle=False), tok)
    assert first.entries[0]["built"] and not again.entries[0]["built"]
    assert [again.records[i]["record"] for i in range(3)] == records
    assert [again.train[p]["record"]["id"] for p in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    rows = TokenDataset.open(Path(again.entries[0]["entry"]) / "rows.arrow")
    values = rows._records[1]
    assert not values.flags.owndata and not values.flags.writeable  # a view of the read-only map, not a copy
    assert [rows.record(i) for i in range(3)] == records
    # Spawned DataLoader workers get the dataset pickled: it re-opens the map, or (in memory) copies.
    assert pickle.loads(pickle.dumps(rows)).record(2) == records[2]
    in_memory = TokenDataset.from_arrays(rows._input_ids, rows._target, rows._offsets, records=rows._records)
    assert pickle.loads(pickle.dumps(in_memory)).record(1) == records[1]


def test_streamed_prompts_carry_their_records_in_groups(tmp_path, tok):
    records = questions(5)
    path = write_jsonl(tmp_path / "p.jsonl", [*records[:2], {"prompt": "x" * 100}, *records[2:]])
    r = recipe(path, tmp_path, streaming=True, stream_block=2, on_bad_record="skip", shuffle=False, group=3)
    r.train.max_steps = 1
    bundle = build_data(r, tok)
    assert isinstance(bundle.train, PromptGroups) and bundle.order(r.run.seed, False).index(7) == 7
    items = [bundle.train[p] for p in range(3 * 6)]  # 5 prompts, then the next pass begins
    assert [it["record"] for it in items[::3]] == [*records, records[0]]
    assert [it["position"] for it in items] == list(range(18))
    assert all(items[p]["record"] == items[p - p % 3]["record"] for p in range(18))
    assert bundle.epoch(14) == 0.0 and bundle.epoch(15) == 1.0  # prompt 5 is the second pass's first
    cached = build_data(recipe(path, tmp_path, on_bad_record="skip", shuffle=False, group=3), tok)
    assert [it["input_ids"].tolist() for it in items[:15]] == [cached.train[p]["input_ids"].tolist() for p in range(15)]


def test_a_streamed_resume_inside_a_group_takes_the_same_items(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", questions(9))
    r = recipe(path, tmp_path, streaming=True, stream_block=4, group=3)
    r.train.max_steps = 1
    straight = build_data(r, tok)
    want = [(straight.train[p]["position"], straight.train[p]["record"]["id"]) for p in range(40)]
    for at in (13, 14, 27):  # inside a group: the cursor is the block holding that prompt
        state = build_data(r, tok).state_at(at)
        resumed = build_data(r, tok)
        resumed.restore(state)
        assert [(resumed.train[p]["position"], resumed.train[p]["record"]["id"]) for p in range(at, 40)] == want[at:]


# --- G completions per prompt ----------------------------------------------------


def test_each_prompt_is_g_consecutive_positions_once_per_epoch(tmp_path, tok):
    G, n = 4, 5
    path = write_jsonl(tmp_path / "p.jsonl", questions(n))
    bundle = build_data(recipe(path, tmp_path, group=G), tok)
    assert bundle.num_rows == n * G and bundle.group == G and bundle.epoch(n * G) == 1.0
    order = bundle.order(0, True)
    items = [bundle.train[order.index(p)] for p in range(3 * n * G)]
    assert [it["position"] for it in items] == list(range(3 * n * G))
    ids = [it["record"]["id"] for it in items]
    epochs = [ids[e * n * G : (e + 1) * n * G] for e in range(3)]
    for epoch in epochs:
        groups = [epoch[k : k + G] for k in range(0, n * G, G)]
        assert all(len(set(g)) == 1 for g in groups)  # one prompt per G aligned positions
        assert sorted(g[0] for g in groups) == list(range(n))  # every prompt once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # shuffled: epochs differ
    assert epochs[0][::G] != list(range(n))


def test_a_resume_from_any_position_reproduces_the_same_items(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", questions(7))
    r = recipe(path, tmp_path, group=4)
    plan = BatchPlan(8, 2, 2, 2)  # 8 completions a step: 2 prompts, dealt to 2 ranks x 2 micro-steps

    def positions(start: int, steps: int) -> list[tuple]:
        bundle = build_data(r, tok)
        out = []
        for rank in range(2):
            sampler = MicroBatchSampler(bundle.order(r.run.seed, True), plan, rank, start, steps)
            for micro in sampler:
                out += [(it["position"], it["record"]["id"]) for it in map(bundle.train.__getitem__, micro)]
        return sorted(out)

    straight = positions(0, 6)
    assert [p for p, _ in straight] == list(range(48))
    for start in (8, 14, 21):  # a step boundary, and positions inside a prompt's group
        steps = (48 - start) // 8
        assert positions(start, steps) == straight[start : start + 8 * steps]


def test_a_mixture_of_two_prompt_sources_is_grouped(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "src": "a"} for i in range(3)])
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": [{"role": "user", "content": f"b{i}"}], "src": "b"} for i in range(2)]
    )
    repeat = build_data(recipe([str(a), {"path": str(b), "weight": 2}], tmp_path, group=2), tok)
    assert repeat.num_rows == (3 + 4) * 2
    srcs = [repeat.train[p]["record"]["src"] for p in range(14)]
    assert Counter(srcs) == {"a": 6, "b": 8} and all(srcs[p] == srcs[p + 1] for p in range(0, 14, 2))

    r = recipe([str(a), {"path": str(b), "weight": 3}], tmp_path, group=2, mixture="probability")
    shares = build_data(r, tok)
    order = shares.order(r.run.seed, r.data.shuffle)
    records = [shares.train[order.index(p)]["record"] for p in range(400)]
    assert all(records[p] == records[p + 1] for p in range(0, 400, 2))
    assert 0.6 < Counter(rec["src"] for rec in records)["b"] / 400 < 0.9


def test_eval_prompts_are_prompt_rows_without_groups(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", questions(10))
    bundle = build_data(recipe(path, tmp_path, eval_fraction=0.2), tok)
    assert len(bundle.eval) == 2 and len(bundle.records) == 8 and bundle.num_rows == 32
    held = [bundle.eval[i] for i in range(2)]
    assert all("record" in it and "position" not in it for it in held)
    assert {it["record"]["id"] for it in held}.isdisjoint(bundle.records[i]["record"]["id"] for i in range(8))
    assert bundle.eval_prompts == []


# --- collation and prepare -------------------------------------------------------


def test_collate_gives_unpadded_prompts_records_positions_and_a_padded_batch(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "short", "k": 1}, {"prompt": MESSAGES, "k": 2}])
    bundle = build_data(recipe(path, tmp_path, group=2, shuffle=False), tok)
    items = [bundle.train[p] for p in range(1, 4)]
    batch = collate(items, tok.pad_token_id)
    assert set(batch) == {"prompt_ids", "records", "positions", "input_ids", "labels", "attention_mask"}
    assert [r["k"] for r in batch["records"]] == [1, 2, 2]
    assert batch["positions"].tolist() == [1, 2, 3] and batch["positions"].dtype == torch.long
    lengths = [len(it["input_ids"]) for it in items]
    assert [p.tolist() for p in batch["prompt_ids"]] == [it["input_ids"].tolist() for it in items]
    assert all(p.dtype == torch.long for p in batch["prompt_ids"])
    assert batch["input_ids"].shape == batch["labels"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["input_ids"][0, lengths[0] :].eq(tok.pad_token_id).all()  # right-padded
    assert (batch["labels"] == IGNORE_INDEX).all() and count_targets(batch["labels"]) == 0
    eval_batch = collate([build_data(recipe(path, tmp_path), tok).records[0]], tok.pad_token_id)
    assert "positions" not in eval_batch and eval_batch["records"] == [{"prompt": "short", "k": 1}]


def test_prepare_builds_the_prompt_entry(tmp_path):
    from llmft.data.prepare import prepare

    path = write_jsonl(tmp_path / "p.jsonl", [json.loads(json.dumps(q)) for q in questions(3)])
    yaml = tmp_path / "r.yaml"
    yaml.write_text(
        "model: {config: {model_type: llama}}\n"
        "train: {objective: grpo, max_steps: 1}\n"
        "rollout: {num_generations: 2, max_new_tokens: 16}\n"
        f"data: {{train: {path}, cache_dir: {tmp_path / 'c'}, max_seq_len: 64}}\n"
    )
    report = prepare(str(yaml), [])
    assert "3 records -> 3 prompts" in report and "built" in report, report
    assert "train: 3 prompts of max_seq_len 64" in report and "2 completions per prompt" in report
    assert "already there" in prepare(str(yaml), [])
