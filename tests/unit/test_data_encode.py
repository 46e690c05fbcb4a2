"""The encoder calls the Rust tokenizer directly (``encode_batch_fast``, no offsets) only where that
is exactly what ``tokenizer(texts)`` runs, and its ids equal the full call's (docs/data.md, Tokenizing)."""

from transformers import PreTrainedTokenizerFast

from llmft.data.encode import Encoder
from llmft.data.records import parse_record
from llmft.data.tokenizer import byte_tokenizer

TEXTS = ["hello world", "", "  spaces  and\ttabs\n", "é中 unicode", "a literal <eos> inside", "x" * 300]


def full_call(tok, texts, special):
    return [list(ids) for ids in tok(texts, add_special_tokens=special)["input_ids"]]


def lists(arrays) -> list[list[int]]:
    return [a.tolist() for a in arrays]


def test_direct_backend_gives_the_ids_of_the_full_call():
    tok = byte_tokenizer()
    enc = Encoder(tok, "all")
    assert enc._backend is tok.backend_tokenizer
    for special in (True, False):
        assert lists(enc._ids_batch(TEXTS, special)) == full_call(tok, TEXTS, special)
    assert enc._backend is not None and enc._backend_checked  # checked once, then used without the full call
    calls = []
    original = tok._encode_plus
    tok._encode_plus = lambda *a, **k: calls.append(1) or original(*a, **k)
    ids = enc._ids_batch(TEXTS, True)
    assert calls == []
    assert lists(ids) == full_call(tok, TEXTS, True)


def test_split_special_tokens_is_followed():
    tok = byte_tokenizer()
    tok.split_special_tokens = True  # "<eos>" in the text is bytes, not the eos token
    enc = Encoder(tok, "all")
    ids = enc._ids_batch(TEXTS, True)
    assert lists(ids) == full_call(tok, TEXTS, True)
    assert tok.eos_token_id not in ids[4]


def test_backend_truncation_left_on_takes_the_full_call():
    tok = byte_tokenizer()
    enc = Encoder(tok, "all")
    tok.backend_tokenizer.enable_truncation(4)  # as another library might leave it
    assert lists(enc._ids_batch(TEXTS, True)) == full_call(tok, TEXTS, True)
    assert max(len(ids) for ids in enc._ids_batch(TEXTS, True)) > 4  # tokenizer(texts) does not truncate


def test_a_tokenizer_that_overrides_encoding_is_called_whole():
    class Lower(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            text = [t.lower() for t in text] if isinstance(text, list) else text.lower()
            return super()._encode_plus(text, *args, **kwargs)

    base = byte_tokenizer()
    tok = Lower(tokenizer_object=base.backend_tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    enc = Encoder(tok, "all")
    assert enc._backend is None
    assert lists(enc._ids_batch(["ABC"], False)) == full_call(tok, ["abc"], False)


def test_a_backend_that_disagrees_on_the_first_batch_is_never_used_again():
    tok = byte_tokenizer()
    enc = Encoder(tok, "all")

    class Wrong:  # a backend whose ids are not the full call's
        truncation = padding = None
        encode_special_tokens = False

        def encode_batch_fast(self, texts, add_special_tokens):
            return [type("E", (), {"ids": [7]})() for _ in texts]

    enc._backend = Wrong()
    assert lists(enc._ids_batch(TEXTS, True)) == full_call(tok, TEXTS, True)
    assert enc._backend is None
    assert lists(enc._ids_batch(TEXTS, False)) == full_call(tok, TEXTS, False)


def test_text_labels_are_the_ids_and_eos_is_appended_once():
    tok = byte_tokenizer()
    enc = Encoder(tok, "all")
    (ex,) = enc.encode_batch([parse_record({"text": "abc"})])
    assert ex.input_ids.tolist() == full_call(tok, ["abc"], True)[0] + [tok.eos_token_id]
    assert ex.labels is ex.input_ids
