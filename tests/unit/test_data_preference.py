"""Preference pairs through the data pipeline: records, tokens, truncation, cache, collation layouts."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import default_recipe, tiny_llama_model, write_jsonl

from llmft.data import build_data, collate
from llmft.data.cache import CACHE_FORMAT
from llmft.data.encode import IGNORE_INDEX, Encoder
from llmft.data.kinds.pairs import parse_pair, truncate_pair
from llmft.data.records import BadRecord, Chat, PromptCompletion, parse_chat, parse_record
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]
PAIR = {"prompt": "reverse: abc\n", "chosen": "cba", "rejected": "abc"}
PROMPT_MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
]
CHOSEN_MSGS = [{"role": "assistant", "content": "six"}]
REJECTED_MSGS = [{"role": "assistant", "content": "seven, I think"}]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def recipe(train, objective="dpo", **data) -> Recipe:
    return default_recipe(train, objective, **data)


def pairs_of(ds) -> list[tuple]:
    """Each pair's (chosen ids, chosen labels, rejected ids, rejected labels)."""
    return [
        tuple(ds[i][s][k].tolist() for s in ("chosen", "rejected") for k in ("input_ids", "labels"))
        for i in range(len(ds))
    ]


def targets(row, tok) -> str:
    return tok.decode([t for t in row["labels"][1:] if t != IGNORE_INDEX])


def error_of(r: Recipe, tok) -> str:
    with pytest.raises(UserError) as e:
        build_data(r, tok)
    return str(e.value)


# --- records and tokens ----------------------------------------------------


def test_string_pair_is_two_prompt_completion_records(tmp_path, tok):
    bundle = build_data(recipe(write_jsonl(tmp_path / "p.jsonl", [PAIR]), cache_dir=str(tmp_path / "c")), tok)
    assert len(bundle.train) == 1
    enc = Encoder(tok, "completion")
    for side in ("chosen", "rejected"):
        want = enc.encode(PromptCompletion(PAIR["prompt"], PAIR[side]))
        got = bundle.train[0][side]
        assert got["input_ids"].tolist() == want.input_ids.tolist() and got["labels"].tolist() == want.labels.tolist()
        assert targets(got, tok) == PAIR[side] + tok.eos_token


def test_chat_pair_targets_only_the_completion_after_the_shared_prompt(tmp_path, tok):
    explicit = {"prompt": PROMPT_MSGS, "chosen": CHOSEN_MSGS, "rejected": REJECTED_MSGS}
    implicit = {"chosen": PROMPT_MSGS + CHOSEN_MSGS, "rejected": PROMPT_MSGS + REJECTED_MSGS}
    path = write_jsonl(tmp_path / "chat.jsonl", [explicit, implicit])
    ds = build_data(recipe(path, cache_dir=str(tmp_path / "c")), tok).train
    assert pairs_of(ds)[0] == pairs_of(ds)[1]  # the shared prefix is the prompt
    enc = Encoder(tok, "completion")
    for side, msgs in (("chosen", CHOSEN_MSGS), ("rejected", REJECTED_MSGS)):
        sft = enc.encode(parse_chat(PROMPT_MSGS + msgs))  # SFT masking: both assistant turns
        row = ds[0][side]
        assert row["input_ids"].tolist() == sft.input_ids.tolist()  # the same rendering and tokens as SFT chat
        # SFT's targets of the conversation, less those of the prompt's own assistant turn
        first_turn = targets({"labels": enc.encode(parse_chat(PROMPT_MSGS[:3])).labels}, tok)
        assert first_turn.startswith("4")
        assert targets(row, tok) == targets({"labels": sft.labels}, tok)[len(first_turn) :]
        assert targets(row, tok).startswith(msgs[0]["content"])


def test_parse_pair_shapes_and_fields():
    p = parse_pair({"q": "x", "good": "y", "bad": "z"}, {"prompt": "q", "chosen": "good", "rejected": "bad"}, "dpo")
    assert p.chosen == PromptCompletion("x", "y") and p.rejected == PromptCompletion("x", "z")
    p = parse_pair({"chosen": PROMPT_MSGS + CHOSEN_MSGS, "rejected": PROMPT_MSGS + REJECTED_MSGS}, None, "reward")
    assert isinstance(p.chosen, Chat) and p.chosen.targets_from == len(PROMPT_MSGS) == p.rejected.targets_from


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"prompt": "a", "chosen": "b", "rejcted": "c"}, "has 'chosen' but no 'rejected' (did you mean 'rejected' for 'rejcted')"),
        ({"promt": "a", "chosen": "b", "rejected": "c"}, "has 'chosen' and 'rejected' but no 'prompt' (did you mean 'prompt' for 'promt')"),
        ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}, "'prompt' is a list: write"),
        ({"prompt": "a", "chosen": CHOSEN_MSGS, "rejected": REJECTED_MSGS}, "'prompt' is a string but 'chosen'"),
        ({"chosen": CHOSEN_MSGS, "rejected": CHOSEN_MSGS}, "need at least one message each after the shared prompt"),
        ({"prompt": "a", "completion": "b"}, "is a prompt/completion record, but train.objective is dpo"),
        ({"messages": CHOSEN_MSGS}, "is a messages record, but train.objective is dpo"),
        ({"text": "a"}, "is a text record, but train.objective is dpo"),
    ],
)  # fmt: skip
def test_bad_pairs_name_line_and_reason(tmp_path, tok, record, why):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR, record])
    msg = error_of(recipe(path, cache_dir=str(tmp_path / "c")), tok)
    assert f"{path}:2" in msg and why in msg, msg


def test_a_pair_under_sft_is_an_error_at_its_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "completion": "b"}, PAIR])
    msg = error_of(recipe(path, objective="sft", cache_dir=str(tmp_path / "c")), tok)
    assert f"{path}:2" in msg and "is a preference pair ('chosen'/'rejected'), but train.objective is sft" in msg
    with pytest.raises(BadRecord, match="preference pair"):
        parse_record(PAIR)


def test_reward_objective_reads_pairs_and_chat_without_assistant_after_prompt_is_bad(tmp_path, tok):
    bad = {"prompt": PROMPT_MSGS[:2], "chosen": [{"role": "user", "content": "x"}], "rejected": REJECTED_MSGS}
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR, bad])
    msg = error_of(recipe(path, objective="reward", cache_dir=str(tmp_path / "c")), tok)
    assert f"{path}:2" in msg and "chosen: has no assistant message after the shared prompt" in msg, msg


# --- truncation --------------------------------------------------------------


def test_truncate_pair_cuts_the_prompt_from_the_left_then_completions_from_the_right():
    prompt, c, r = np.arange(10), np.array([100, 101, 102]), np.array([200, 201, 202, 203, 204, 205])
    chosen, rejected = np.concatenate([prompt, c]), np.concatenate([prompt, r])
    tc = np.r_[np.zeros(10), np.ones(3)].astype(np.uint8)
    tr = np.r_[np.zeros(10), np.ones(6)].astype(np.uint8)
    # 16 tokens into 12: the prompt loses its first 4 (it keeps >= 6 = 12 // 2), no completion cut
    assert truncate_pair(chosen, rejected, tc, tr, 12) == (slice(4, 13), slice(4, 16))
    # into 8: the prompt keeps its last 4 (the floor), the longer completion is cut to 4
    assert truncate_pair(chosen, rejected, tc, tr, 8) == (slice(6, 13), slice(6, 14))
    assert truncate_pair(chosen, rejected, tc, tr, 16) == (slice(0, 13), slice(0, 16))  # fits: nothing cut


def test_long_pairs_are_truncated_and_counted(tmp_path, tok):
    long_prompt = {"prompt": "p" * 40, "chosen": "good", "rejected": "bad"}
    long_answer = {"prompt": "q", "chosen": "x" * 50, "rejected": "y"}
    no_room = {"prompt": "z" * 60, "chosen": "c", "rejected": "r"}  # the prompt keeps its last 30 tokens
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR, long_prompt, long_answer, no_room])
    bundle = build_data(recipe(path, max_seq_len=32, cache_dir=str(tmp_path / "c")), tok)
    ds = bundle.train
    assert len(ds) == 4 and bundle.stats["truncated"] == 3 and bundle.stats["dropped_no_targets"] == 0
    for i in range(4):
        for side in ("chosen", "rejected"):
            assert len(ds[i][side]["input_ids"]) <= 32
    assert tok.decode(ds[1]["chosen"]["input_ids"]) == "p" * 27 + "good" + tok.eos_token  # prompt cut on the left
    assert targets(ds[2]["chosen"], tok) == "x" * 30  # <bos>q + 30: completion cut on the right, eos gone
    assert targets(ds[2]["rejected"], tok) == "y" + tok.eos_token
    # train_on: all leaves no prompt to cut (every token is a target): a long pair keeps its start
    r = recipe(path, max_seq_len=8, train_on="all", cache_dir=str(tmp_path / "c"))
    assert build_data(r, tok).train[1]["chosen"]["input_ids"][0] == tok.bos_token_id


def test_pair_with_no_target_left_is_dropped_and_counted(tmp_path, tok):
    from llmft.data.kinds.pairs import REJECTED_START, build_pair_rows

    # pair 0: rejected's only target is past max_seq_len 3 once the prompt (1 token) keeps its floor
    # (e.g. a chat completion that opens with a long non-target turn); pair 1 fits
    seqs = [([1, 2, 3], [0, 0, 1]), ([1, 5, 6, 7, 8], [0, 0, 0, 0, 1]), ([1, 2, 3], [0, 0, 1]), ([1, 4], [0, 1])]
    ids = np.array([t for s, _ in seqs for t in s], dtype=np.int32)
    target = [np.array(t, dtype=np.uint8) for _, t in seqs]
    target[1][0] |= REJECTED_START
    target[3][0] |= REJECTED_START
    offsets = np.array([0, 8, 13], dtype=np.int64)
    cfg = recipe("x").data
    cfg.max_seq_len = 3
    rows, stats = build_pair_rows(ids, np.concatenate(target), offsets, np.array([0, 1]), cfg, "data.train")
    assert len(rows) == 1 and stats["dropped_no_targets"] == 1 and stats["truncated"] == 1
    assert rows[0]["chosen"]["input_ids"].tolist() == [1, 2, 3]
    assert rows[0]["rejected"]["labels"].tolist() == [IGNORE_INDEX, 4]
    with pytest.raises(UserError, match="no pair keeps a target token in both chosen and rejected"):
        build_pair_rows(ids, np.concatenate(target), offsets, np.array([0]), cfg, "data.train")
    # through build_data: max_seq_len 1 leaves no target anywhere (labels[0] is never one)
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR])
    msg = error_of(recipe(path, max_seq_len=1, cache_dir=str(tmp_path / "c")), tok)
    assert "no pair keeps a target token in both chosen and rejected within data.max_seq_len=1" in msg


def test_vectorised_pair_rows_are_truncate_pair_on_every_pair():
    from llmft.data.kinds.pairs import REJECTED_START, build_pair_rows

    rng = np.random.default_rng(0)
    ids, target, offsets, want = [], [], [0], []
    for _ in range(400):
        prompt = rng.integers(0, 4, int(rng.integers(0, 12)))  # a small alphabet: completions often start alike
        sides = [np.concatenate([prompt, rng.integers(0, 4, int(rng.integers(0, 10)))]) for _ in range(2)]
        masks = []
        for seq in sides:
            t = (np.arange(len(seq)) >= len(prompt) - int(rng.integers(0, 2))).astype(np.uint8)
            t &= rng.random(len(seq)) < 0.9  # some completion tokens are not targets
            masks.append(t)
        if not len(sides[0]) or not len(sides[1]):
            continue
        keep = truncate_pair(sides[0], sides[1], masks[0], masks[1], 7)
        kept = [(s[k].tolist(), m[k]) for s, m, k in zip(sides, masks, keep, strict=True)]
        if all(m[1:].any() for _, m in kept):
            want.append(tuple((s, np.where(m == 1, s, IGNORE_INDEX).tolist()) for s, m in kept))
        marked = masks[1].copy()
        marked[0] |= REJECTED_START
        ids += [sides[0], sides[1]]
        target += [masks[0], marked]
        offsets.append(offsets[-1] + len(sides[0]) + len(sides[1]))
    cfg = recipe("x").data
    cfg.max_seq_len = 7
    items = np.arange(len(offsets) - 1)
    rows, stats = build_pair_rows(
        np.concatenate(ids).astype(np.int32), np.concatenate(target), np.array(offsets), items, cfg, "k"
    )
    got = [
        tuple((rows[i][s]["input_ids"].tolist(), rows[i][s]["labels"].tolist()) for s in ("chosen", "rejected"))
        for i in range(len(rows))
    ]
    assert got == want and stats["dropped_no_targets"] == len(items) - len(want) > 0


# --- the cache -------------------------------------------------------------------


def test_pair_entries_are_their_own_format_and_never_read_as_sft(tmp_path, tok):
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}])
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "a", "completion": "b", "chosen": "x", "rejected": "y"}])
    cache = str(tmp_path / "c")
    b_sft = build_data(recipe(both, objective="sft", cache_dir=cache), tok)
    b_dpo = build_data(recipe(both, objective="dpo", cache_dir=cache), tok)
    b_reward = build_data(recipe(both, objective="reward", cache_dir=cache), tok)
    entries = {b.entries[0]["entry"] for b in (b_sft, b_dpo, b_reward)}
    assert len(entries) == 3  # the objective is part of the key
    assert "chosen" not in b_sft.train[0] and "chosen" in b_dpo.train[0]
    meta = json.loads((Path(b_dpo.entries[0]["entry"]) / "meta.json").read_text())
    assert meta["parts"]["format"] == "pairs-2" and meta["parts"]["objective"] == "dpo"
    sft_meta = json.loads((Path(b_sft.entries[0]["entry"]) / "meta.json").read_text())
    assert "objective" not in sft_meta["parts"] and sft_meta["parts"]["format"] == CACHE_FORMAT  # SFT keys unchanged
    assert build_data(recipe(sft, objective="sft", cache_dir=cache), tok).train[0]["position_ids"] is None
    # padded and padding-free runs share the pair entry (the layout is chosen at collation)
    packed = build_data(recipe(both, objective="dpo", packing=True, cache_dir=cache), tok)
    assert packed.entries[0]["entry"] == b_dpo.entries[0]["entry"] and not packed.entries[0]["built"]


def test_eval_fraction_holds_out_whole_pairs(tmp_path, tok):
    records = [{"prompt": f"w{i}:", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    bundle = build_data(recipe(path, eval_fraction=0.25, cache_dir=str(tmp_path / "c")), tok)
    assert len(bundle.train) == 15 and len(bundle.eval) == 5
    seen = []
    for ds in (bundle.train, bundle.eval):
        for i in range(len(ds)):
            c, r = (tok.decode(ds[i][s]["input_ids"]) for s in ("chosen", "rejected"))
            k = c.split(":")[0][len("<bos>w") :]
            assert c.endswith(f"c{k}<eos>") and r.endswith(f"r{k}<eos>")  # chosen stays with its rejected
            seen.append(int(k))
    assert sorted(seen) == list(range(20))
    assert bundle.eval_prompts and bundle.eval_prompts[0][1].startswith("c")


def test_mixture_counts_pairs(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [PAIR] * 3)
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "chosen": "y", "rejected": "z"}] * 4)
    train = [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}]
    bundle = build_data(recipe(train, cache_dir=str(tmp_path / "c")), tok)
    assert len(bundle.train) == 3 * 2 + 2 and bundle.stats["pairs"] == 7
    assert all("chosen" in bundle.train[i] for i in range(len(bundle.train)))
    shares = build_data(recipe(train, mixture="probability", cache_dir=str(tmp_path / "c")), tok)
    assert shares.probabilities == [2 / 2.5, 0.5 / 2.5] and len(shares.train) == 7
    order = shares.order(seed=0, shuffle=True)
    assert all("rejected" in shares.train[order.index(p)] for p in range(20))


def test_streamed_pairs_equal_cached_pairs(tmp_path, tok):
    records = [{"prompt": f"w{i}:", "chosen": f"c{i}" * (i % 4 + 1), "rejected": f"r{i}"} for i in range(11)]
    path = write_jsonl(tmp_path / "p.jsonl", records + [{"prompt": "x", "completion": "y"}])
    cached = build_data(recipe(path, on_bad_record="skip", shuffle=False, cache_dir=str(tmp_path / "c")), tok)
    r = recipe(path, on_bad_record="skip", shuffle=False, streaming=True, stream_block=4)
    r.train.max_steps = 1
    streamed = build_data(r, tok).train
    assert [_pair(streamed[p]) for p in range(11)] == [_pair(cached.train[i]) for i in range(11)]
    assert _pair(streamed[11]) == _pair(cached.train[0])  # the next pass


def _pair(item):
    return tuple(tuple(item[s][k]) for s in ("chosen", "rejected") for k in ("input_ids", "labels"))


def test_fields_mapping_and_prepare_report(tmp_path, tok, monkeypatch):
    from llmft.data.prepare import prepare

    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "a", "good": "b", "bad": "c"}] * 3)
    yaml = tmp_path / "r.yaml"
    yaml.write_text(
        "model: {config: {model_type: llama}}\ntrain: {objective: dpo, max_steps: 1}\n"
        f"data: {{train: {{path: {path}, fields: {{prompt: q, chosen: good, rejected: bad}}}}, "
        f"cache_dir: {tmp_path / 'c'}, max_seq_len: 64}}\n"
    )
    report = prepare(str(yaml), [])
    assert "3 records -> 3 pairs (6 sequences)" in report, report


# --- collation --------------------------------------------------------------------


def layouts(tmp_path, tok, records):
    path = write_jsonl(tmp_path / "p.jsonl", records)
    items = {}
    for packing in (False, True):
        ds = build_data(recipe(path, packing=packing, cache_dir=str(tmp_path / "c")), tok).train
        items[packing] = collate([ds[i] for i in range(len(ds))], tok.pad_token_id)
    return items[False], items[True]


PAIRS = [
    PAIR,
    {"prompt": "reverse: hello\n", "chosen": "olleh", "rejected": "hello"},
    {"prompt": "q", "chosen": "a much longer answer", "rejected": "no"},
]


def sequences(batch) -> list[tuple]:
    """(input ids, labels, positions) of each sequence s, in order of s."""
    out = []
    seq = batch["sequence_index"]
    for s in range(2 * batch["num_pairs"]):
        at = seq == s
        out.append(tuple(batch[k][at].tolist() for k in ("input_ids", "labels", "position_ids")))
    return out


def test_both_layouts_hold_the_same_sequences(tmp_path, tok):
    plain, flat = layouts(tmp_path, tok, PAIRS)
    assert plain["input_ids"].shape[0] == 6 and flat["input_ids"].shape[0] == 1
    assert "attention_mask" in plain and "attention_mask" not in flat
    assert plain["num_pairs"] == flat["num_pairs"] == 3
    assert sequences(plain) == sequences(flat)
    assert (flat["sequence_index"] >= 0).all()  # padding-free: no pad at all (non-pad fraction 1.0)
    assert (plain["sequence_index"] == -1).sum() > 0 and (plain["labels"][plain["sequence_index"] == -1] == -100).all()
    for s, (ids, _, pos) in enumerate(sequences(plain)):
        assert pos == list(range(len(ids)))
        side = "chosen" if s % 2 == 0 else "rejected"
        assert tok.decode(ids).endswith(PAIRS[s // 2][side] + tok.eos_token)


def sequence_logps(model, batch) -> torch.Tensor:
    """Summed target log-probs per sequence: logits at t predict labels at t + 1 of the same sequence."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    labels, seq = batch["labels"][:, 1:], batch["sequence_index"]
    valid = (labels != IGNORE_INDEX) & (seq[:, 1:] == seq[:, :-1])
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(2 * batch["num_pairs"], dtype=torch.float64)
    return out.index_add_(0, seq[:, 1:][valid], (logp * valid)[valid].double())


def test_padding_free_gives_the_padded_log_probs(tmp_path, tok):
    model = tiny_llama_model(num_key_value_heads=4, max_position_embeddings=128)
    plain, flat = layouts(tmp_path, tok, PAIRS)
    want, got = sequence_logps(model, plain), sequence_logps(model, flat)
    assert (want < 0).all()
    assert torch.allclose(want, got, rtol=1e-6, atol=0), want - got  # measured: 1.4e-8 relative


def test_padding_free_sequences_do_not_attend_to_each_other(tmp_path, tok):
    model = tiny_llama_model(num_key_value_heads=4, max_position_embeddings=128)
    _, flat = layouts(tmp_path, tok, PAIRS[:1])
    (tmp_path / "more").mkdir()
    _, longer = layouts(tmp_path / "more", tok, PAIRS[1:2] + PAIRS[:1])
    with torch.no_grad():
        # use_cache=False as in training: with a KV cache transformers does not split a row at restarts
        alone = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=False).logits[0]
        after = model(input_ids=longer["input_ids"], position_ids=longer["position_ids"], use_cache=False).logits[0]
    n = alone.shape[0]
    # the same pair placed after another pair's two sequences: the same logits, token for token
    assert torch.allclose(after[-n:], alone, rtol=0, atol=1e-5)
    # and the rejected sequence of the row is not seen by the chosen one before it, nor the other way
    chosen = int((flat["sequence_index"][0] == 0).sum())
    with torch.no_grad():
        first = model(input_ids=flat["input_ids"][:, :chosen], use_cache=False).logits[0]
        second = model(input_ids=flat["input_ids"][:, chosen:], use_cache=False).logits[0]
    assert torch.allclose(torch.cat([first, second]), alone, rtol=0, atol=1e-5)


# --- the demo data ------------------------------------------------------------------


def test_preference_demo_data_is_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_preference_data", ROOT / "scripts/make_preference_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data/preference" / name).read_bytes(), name
        pairs = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        for p in pairs:
            word = p["prompt"][len("reverse: ") : -1]
            assert p["chosen"] == word[::-1] != p["rejected"] and len(p["rejected"]) == len(word)
    assert sum((ROOT / "data/preference" / n).stat().st_size for n in ("train.jsonl", "eval.jsonl")) < 1 << 20


def test_demo_pairs_build_whole_with_the_quickstart_settings(tmp_path, tok):
    data = ROOT / "data/preference"
    r = recipe(data / "train.jsonl", max_seq_len=64, cache_dir=str(tmp_path / "c"))
    r.data.eval = str(data / "eval.jsonl")
    bundle = build_data(r, tok)
    assert len(bundle.train) == 3000 and len(bundle.eval) == 200 and len(bundle.eval_prompts) == 200
    assert bundle.stats["truncated"] == bundle.stats["dropped_no_targets"] == bundle.stats["skipped"] == 0
    prompt_ids, reference = bundle.eval_prompts[0]
    assert tok.decode(prompt_ids) == "<bos>reverse: bababb\n" and reference == "bbabab"
