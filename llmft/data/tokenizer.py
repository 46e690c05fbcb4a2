"""The tokenizer of a run: the model's own, a named one, or the built-in byte tokenizer.

The byte tokenizer exists so that tests, demos and from-scratch runs
(``model.config``) need no download: ids 0-255 are the raw UTF-8 bytes, the
special tokens follow, and the whole vocabulary stays under 320 so that a
model config with ``vocab_size: 320`` always covers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmft.errors import Problem, UserError, library_problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from llmft.recipe.schema import ModelConfig

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 256, 257, ... in this order
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Every turn is "<|role|>\n" + content + a terminator, with nothing in between
# turns, so the tokens of an assistant turn are exactly its content plus eos: the
# model learns to stop with eos, the same token that ends text and completion
# records. {% generation %} lets transformers' return_assistant_tokens_mask work.
# Tool results are a "tool" turn; an assistant's tool calls follow its content as JSON.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] or '' }}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "{{ eos_token }}{% endgeneration %}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>"
    "{% elif message['role'] in ['tool', 'function'] %}"
    "<|tool|>\n{{ message['content'] }}<|end|>"
    "{% else %}"
    "{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Templates ``data.chat_template`` may name instead of a file. Each renders prefixes of a
# conversation as prefixes (what assistant-only masking needs) and tool turns.
BUILTIN_TEMPLATES = {
    "llmft": CHAT_TEMPLATE,
    "chatml": (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
        "{% for call in message['tool_calls'] or [] %}<tool_call>\n{{ call | tojson }}\n</tool_call>{% endfor %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% set role = 'ipython' if message['role'] in ['tool', 'function'] else message['role'] %}"
        "<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ (message['content'] or '') | trim }}"
        "{% for call in message['tool_calls'] or [] %}{{ call | tojson }}{% endfor %}"
        "<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}


def use_chat_template(tokenizer: PreTrainedTokenizerBase, value: str | None) -> None:
    """Apply ``data.chat_template`` (a file, or a name in ``BUILTIN_TEMPLATES``) to ``tokenizer``; None keeps its own."""
    if value is None:
        return
    path = Path(value).expanduser()
    if path.is_file():
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    elif value in BUILTIN_TEMPLATES:
        tokenizer.chat_template = BUILTIN_TEMPLATES[value]
    else:
        import difflib  # only to suggest a name when the user's is unknown

        close = difflib.get_close_matches(value, BUILTIN_TEMPLATES, n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise UserError(
            Problem(
                "data.chat_template",
                f"'{value}' is neither a file nor a built-in template ({', '.join(BUILTIN_TEMPLATES)})",
                f"{hint}Give the path of a Jinja template file, or one of the built-in names.",
            )
        )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenizers emit)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: byte ids 0-255, special tokens from 256, a chat template.

    Encoding adds ``<bos>`` (like most causal-LM tokenizers); eos is appended
    by the data pipeline, not by the tokenizer.
    """
    # tokenizers and transformers are heavy: loaded only when a tokenizer is built
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == BYTE_VOCAB_SIZE < 320
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
    )


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """``model.tokenizer`` if set, else the model's own, else (``model.config``) the byte tokenizer.

    A tokenizer without a pad token gets its eos token as pad. That is safe
    here because the data pipeline never derives labels or attention from
    ``input_ids == pad_id``: pads are marked by position, so a real eos stays a
    target.
    """
    if model_cfg.tokenizer:
        tokenizer = _from_pretrained(model_cfg.tokenizer, "model.tokenizer", model_cfg, revision=None)
    elif model_cfg.name_or_path:
        tokenizer = _from_pretrained(
            model_cfg.name_or_path, "model.name_or_path", model_cfg, revision=model_cfg.revision
        )
    elif model_cfg.config is not None:
        return byte_tokenizer()
    else:
        raise UserError(
            Problem("model", "names no model", "Set model.name_or_path, or model.config to build a fresh model.")
        )
    _ensure_pad(tokenizer, model_cfg.tokenizer or model_cfg.name_or_path)
    return tokenizer


def _from_pretrained(name: str, key: str, model_cfg: ModelConfig, revision: str | None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # heavy: loaded only when a tokenizer is read

    looks_local = name.startswith((".", "/", "~")) or Path(name).expanduser().exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(Problem(key, f"directory '{name}' does not exist", "Check the path."))
    try:
        return AutoTokenizer.from_pretrained(
            str(Path(name).expanduser()) if looks_local else name,
            trust_remote_code=model_cfg.trust_remote_code,
            revision=revision,
        )
    except Exception as e:  # noqa: BLE001 - a damaged file raises tokenizers' or transformers' own errors too
        local = looks_local and Path(name).expanduser().is_dir()
        raise UserError(
            library_problem(
                key,
                f"no tokenizer could be loaded from '{name}'",
                e,
                name=name,
                local=local,
                fix="Point it at a directory with tokenizer files or a hub id in the local cache "
                "(offline runs need HF_HOME to hold it), or set model.tokenizer.",
            )
        ) from e


def _ensure_pad(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise UserError(
            Problem(
                "model.tokenizer",
                f"the tokenizer of '{name}' has neither a pad nor an eos token",
                "Use a tokenizer that defines eos_token (or pad_token) in its tokenizer_config.json.",
            )
        )
    tokenizer.pad_token = tokenizer.eos_token
