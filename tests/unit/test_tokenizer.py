import pytest
from transformers import AutoTokenizer

from llmft.data.tokenizer import BYTE_VOCAB_SIZE, SPECIAL_TOKENS, byte_tokenizer, load_tokenizer
from llmft.errors import UserError
from llmft.recipe.schema import ModelConfig

CHAT = [
    {"role": "system", "content": "Be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "héllo"},
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_byte_ids_are_raw_bytes_and_specials_follow(tok):
    text = "héllo 🤗"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok(text)["input_ids"] == [tok.bos_token_id, *ids]
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(256, 256 + len(SPECIAL_TOKENS)))
    assert len(tok) == BYTE_VOCAB_SIZE < 320
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.decode(ids) == text


def test_special_tokens_in_text_are_single_tokens(tok):
    ids = tok("a<|user|>b<eos>", add_special_tokens=False)["input_ids"]
    assert ids == [ord("a"), tok.convert_tokens_to_ids("<|user|>"), ord("b"), tok.eos_token_id]


def test_chat_template_and_generation_prompt(tok):
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<bos><|system|>\nBe brief<|end|><|user|>\nhi<|end|><|assistant|>\nhéllo<eos>"
    )
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><|system|>\nBe brief<|end|><|user|>\nhi<|end|><|assistant|>\n"


def test_generation_markers_give_the_assistant_mask(tok):
    out = tok.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "héllo<eos>"


def test_save_and_auto_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "x 🤗 <|assistant|>"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (256, 257, 258)


def test_load_tokenizer_picks_byte_tokenizer_for_model_config():
    tok = load_tokenizer(ModelConfig(config={"model_type": "llama"}))
    assert len(tok) == BYTE_VOCAB_SIZE


def test_load_tokenizer_from_dir_adds_eos_as_pad(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"pad_token": "<pad>",', ""))
    loaded = load_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded.pad_token == "<eos>"
    # model.tokenizer wins over the model's own
    assert load_tokenizer(ModelConfig(name_or_path="/nowhere", tokenizer=str(tmp_path))).eos_token == "<eos>"


def test_missing_tokenizer_is_a_user_error(tmp_path):
    with pytest.raises(UserError) as e:
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "gone")))
    assert str(e.value) == f"model.name_or_path: directory '{tmp_path / 'gone'}' does not exist. Check the path."
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        load_tokenizer(ModelConfig(name_or_path="/nowhere", tokenizer=str(tmp_path / "empty")))
    assert str(e.value).startswith(f"model.tokenizer: no tokenizer could be loaded from '{tmp_path / 'empty'}'")
