"""Property-based fuzzing of model config.json fields and of reward model directories.

Model configs: a tiny llama or qwen2 config whose size fields (hidden_size, num_hidden_layers, heads,
key/value heads, head_dim, intermediate_size, vocab_size, positions; also nested under text_config)
get random values of every type (huge ints, 0, negatives, floats with NaN and inf, strings, null,
booleans, lists, objects, lists nested hundreds deep, ints of 5,000 digits), or are dropped, or the
whole file is replaced (random bytes, a JSON scalar or list, a cut-off text). The config is a model
directory's ``config.json`` (``model.name_or_path``) or the recipe's ``model.config``, run through
``llmft plan`` or ``llmft train`` up to where it would start the process group, then through the
build's config step (``llmft.model.source.model_config``: what ``build_model`` does before it
allocates the model). Properties, for every example:

- the command returns 0 or exits 2 with one message ``llmft CMD: error: ...``, one paragraph, no
  traceback; the build's config step returns a config or raises a ``UserError``, nothing else;
- a size field given a value that is not a whole number in its range is refused, and the message
  names that field;
- an accepted config makes at most ``MODEL_PARAMS_MAX`` parameters by the planner's own arithmetic
  (``ModelShape.num_params``), and no torch factory is asked for more than 2**26 elements;
- it ends within the deadline.

Reward model directories: a real one-label reward model dir, damaged at random (config.json gone,
random bytes or JSON, architectures of another head, id2label of several labels, sizes absurd, the
weights without ``score.weight``, the safetensors header or file cut or overwritten), passed to
``load_reward_model`` and to ``llmft compile`` of a GRPO recipe. Properties: the model loads with a
trained one-row score head (the one its files hold), or a ``UserError`` naming ``rewards[0].model`` in one paragraph (exit 2
from compile); never another exception or a traceback.

The default suite runs a fixed, derandomized set (the same every run); ``-m slow`` runs many more,
freshly drawn.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
from grpo_runs import grpo_recipe
from helpers import TINY_LLAMA, save_tiny_pretrained, write_recipe
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from llmft import limits
from llmft.cli import main
from llmft.errors import UserError

HUGE = 2**26  # elements: far more than any tensor of the tiny models (their largest has 20480)
BASES = {
    "llama": TINY_LLAMA,
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2"},
}
# (field, smallest value, may be null): the size fields a fuzzed value goes to
FIELDS = {
    "hidden_size": (1, False),
    "num_hidden_layers": (1, False),
    "num_attention_heads": (1, False),
    "intermediate_size": (1, False),
    "num_key_value_heads": (1, True),
    "head_dim": (1, True),
    "vocab_size": (1, True),
    "max_position_embeddings": (1, True),
}


class _Digits:
    """An integer of ``n`` digits, written into config.json as its text (json.dumps cannot)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"<int of {self.n} digits>"


def _nested(depth: int, leaf) -> list:
    out = leaf
    for _ in range(depth):
        out = [out]
    return out


values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(limits.MODEL_SIZE_MAX - 2, limits.MODEL_SIZE_MAX + 2),
    st.integers(limits.MODEL_LAYERS_MAX - 2, limits.MODEL_LAYERS_MAX + 2),
    st.integers(-3, 3),
    st.integers(1, 256),
    st.sampled_from([10**9, 10**12, 10**15, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([64.0, 0.5, 1e300, -0.0]),
    st.text(max_size=8),
    st.sampled_from(["64", "1e3", "", "auto"]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(0, 100), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.builds(_nested, st.integers(1, 400), st.integers(1, 64)),
    st.integers(4290, 5200).map(_Digits),
)


@st.composite
def configs(draw):
    """(where the config goes: dir | recipe, the config dict or replacement bytes, the fields set)."""
    place = draw(st.sampled_from(["dir", "dir", "recipe"]))
    cfg = dict(BASES[draw(st.sampled_from(list(BASES)))])
    if place == "dir" and draw(st.integers(0, 9)) == 0:  # the whole file replaced
        whole = draw(
            st.one_of(
                st.binary(max_size=40),
                st.sampled_from([b"[]", b"7", b"null", b'"x"', b"{", json.dumps(cfg)[:40].encode(), b"\xff\xfe{}"]),
            )
        )
        return place, whole, {}
    changed = {}
    for field in draw(st.lists(st.sampled_from(list(FIELDS)), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 7)) == 0:
            cfg.pop(field, None)
        else:
            changed[field] = cfg[field] = draw(values)
    if draw(st.integers(0, 5)) == 0:  # a nested text_config holding sizes
        cfg["text_config"] = draw(st.one_of(st.just(dict(cfg)), values))
    return place, cfg, changed


def _bad(field: str, value) -> bool:
    """Whether ``value`` is one the check must refuse for ``field``."""
    low, nullable = FIELDS[field]
    if value is None:
        return not nullable
    if isinstance(value, bool) or not isinstance(value, int):
        return True
    high = {"max_position_embeddings": limits.MODEL_POSITIONS_MAX, "num_hidden_layers": limits.MODEL_LAYERS_MAX}.get(
        field, limits.MODEL_SIZE_MAX
    )
    return not low <= value <= high


def _config_text(cfg) -> bytes:
    if isinstance(cfg, bytes):
        return cfg
    marks = {}

    def encode(v):
        if isinstance(v, _Digits):
            marks[f"__digits_{len(marks)}__"] = "9" * v.n
            return list(marks)[-1]
        if isinstance(v, dict):
            return {k: encode(x) for k, x in v.items()}
        return v

    text = json.dumps(encode(cfg))
    for mark, digits in marks.items():
        text = text.replace(f'"{mark}"', digits)
    return text.encode()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("fuzz-model") / "hf", seed=1)


@contextlib.contextmanager
def _guarded():
    """Torch factories refuse (and record) more than HUGE elements while the example runs."""
    asked: list[tuple[str, int]] = []
    patches = []
    for name in ("empty", "zeros", "ones", "full", "rand", "randn"):
        real = getattr(torch, name)

        def factory(*args, _real=real, _name=name, **kwargs):
            size = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else args
            dims = [int(d) for d in size if isinstance(d, int)] if isinstance(size, (tuple, list, torch.Size)) else []
            if dims and math.prod(dims) > HUGE:
                asked.append((_name, math.prod(dims)))
                raise MemoryError(f"fuzz guard: torch.{_name} of {math.prod(dims)} elements")
            return _real(*args, **kwargs)

        patches.append(mock.patch.object(torch, name, factory))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield asked


class _Reached(Exception):
    """Raised where ``llmft train`` would start the process group: every check passed."""


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        mock.patch("llmft.training.train.init_distributed", side_effect=_Reached),
    ):
        try:
            code = main(argv)
        except _Reached:
            code = 0
    return code, err.getvalue()


def _one_paragraph(command: str, message: str) -> str:
    assert "Traceback" not in message, message
    head = re.search(f"^llmft {command}: error: ", message, re.M)
    assert head, message
    body = message[head.end() :].strip()
    assert body and "\n\n" not in body, message
    return body


def _check_config(tiny_dir: Path, example, command: str) -> None:
    from llmft.model.source import model_config
    from llmft.plan.shape import ModelShape
    from llmft.recipe import load_recipe

    place, cfg, changed = example
    with tempfile.TemporaryDirectory(prefix="llmft-fuzz-config-") as tmp:
        tmp = Path(tmp)
        if place == "dir":
            d = tmp / "model"
            d.mkdir()
            for f in tiny_dir.iterdir():  # the tokenizer beside it; weights are never read before allocation
                if f.name != "config.json" and not f.name.endswith(".safetensors"):
                    shutil.copy(f, d / f.name)
            (d / "config.json").write_bytes(_config_text(cfg))
            model = {"name_or_path": str(d), "dtype": "fp32", "attn_implementation": "eager"}
            recipe = write_recipe(tmp, model=model)
        else:
            if "<int of " in repr(cfg):
                return  # a YAML recipe's own number limits are test_fuzz_recipe's
            recipe = write_recipe(tmp, model__config=cfg)
        with _guarded() as asked:
            code, message = _cli([command, str(recipe)])
            assert code in (0, 2), (code, message[-3000:])
            body = _one_paragraph(command, message) if code == 2 else ""
            bad = [f for f, v in changed.items() if _bad(f, v)]
            if bad and "text_config" not in (cfg if isinstance(cfg, dict) else {}):
                assert code == 2, (changed, message)
                # the field, or (a recipe's model.config) the recipe line its value is on
                assert any(f in body for f in bad) or (place == "recipe" and f"{recipe}:" in body), (changed, body)
            if code == 0 and command == "train":  # the build's config step, up to the allocation
                try:
                    model_config(load_recipe(recipe).model)
                except UserError as e:
                    assert "Traceback" not in str(e)
                if isinstance(cfg, dict) and "hidden_size" in cfg:
                    assert ModelShape.from_config(cfg).num_params <= limits.MODEL_PARAMS_MAX
        assert asked == [], asked


COMMON = dict(
    deadline=timedelta(seconds=10),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
# No shrinking in the default tier: a failure shows its example at once (shrinking one can outlast the timeout).
DEFAULT = settings(max_examples=40, derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate], **COMMON)
SLOW = settings(max_examples=200, derandomize=False, print_blob=True, **COMMON)


@pytest.mark.timeout(180)
@DEFAULT
@given(example=configs(), command=st.sampled_from(["plan", "train"]))
def test_fuzzed_model_configs(tiny_dir, example, command):
    _check_config(tiny_dir, example, command)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@SLOW
@given(example=configs(), command=st.sampled_from(["plan", "train"]))
def test_fuzzed_model_configs_many(tiny_dir, example, command):
    _check_config(tiny_dir, example, command)


# ---------------------------------------------------------------- reward model directories


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from llmft.data.tokenizer import byte_tokenizer

    out = tmp_path_factory.mktemp("fuzz-reward") / "rm"
    torch.manual_seed(3)
    tok = byte_tokenizer()
    config = AutoConfig.for_model(**{**TINY_LLAMA, "num_labels": 1, "pad_token_id": tok.pad_token_id})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


damages = st.one_of(
    st.tuples(st.just("no-config")),
    st.tuples(st.just("config-bytes"), st.binary(max_size=30)),
    st.tuples(st.just("config-json"), st.sampled_from(["[]", "7", "null", "{}", '{"model_type": "llama"}'])),
    st.tuples(
        st.just("architectures"),
        st.one_of(
            st.lists(st.sampled_from(["LlamaForCausalLM", "LlamaForSequenceClassification", "LlamaModel", "X"])),
            values,
        ),
    ),
    st.tuples(st.just("labels"), st.integers(0, 4)),
    st.tuples(st.just("field"), st.sampled_from(list(FIELDS)), values),
    st.tuples(st.just("no-head")),
    st.tuples(st.just("cut-weights"), st.integers(0, 4000)),
    st.tuples(st.just("header-bytes"), st.binary(min_size=8, max_size=8)),
    st.tuples(st.just("as-file")),
    st.tuples(st.just("none")),
)


def _damage(rm: Path, damage: tuple) -> Path:
    from safetensors.torch import load_file, save_file

    kind, *args = damage
    config, weights = rm / "config.json", rm / "model.safetensors"
    cfg = json.loads(config.read_text())
    if kind == "no-config":
        config.unlink()
    elif kind == "config-bytes":
        config.write_bytes(args[0])
    elif kind == "config-json":
        config.write_text(args[0])
    elif kind == "architectures":
        config.write_bytes(_config_text({**cfg, "architectures": args[0]}))
    elif kind == "labels":
        labels = {str(i): f"LABEL_{i}" for i in range(args[0])}
        config.write_text(json.dumps({**cfg, "id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}))
    elif kind == "field":
        config.write_bytes(_config_text({**cfg, args[0]: args[1]}))
    elif kind == "no-head":
        tensors = load_file(weights)
        del tensors["score.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif kind == "cut-weights":
        weights.write_bytes(weights.read_bytes()[: args[0]])
    elif kind == "header-bytes":
        weights.write_bytes(args[0] + weights.read_bytes()[8:])
    elif kind == "as-file":
        shutil.rmtree(rm)
        rm.with_suffix(".json").write_text("{}")
        return rm.with_suffix(".json")
    return rm


def _check_reward_dir(reward_dir: Path, damage: tuple) -> None:
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.objectives.rewards import load_reward_model

    with tempfile.TemporaryDirectory(prefix="llmft-fuzz-reward-") as tmp:
        rm = _damage(Path(shutil.copytree(reward_dir, Path(tmp) / "rm")), damage)
        with _guarded() as asked:
            try:
                model, _ = load_reward_model(str(rm), "rewards[0].model", torch.device("cpu"), byte_tokenizer(), False)
            except UserError as e:
                text = str(e)
                assert text.startswith("rewards[0].model: ") or "rewards[0].model: " in text, text
                assert "Traceback" not in text and "\n\n" not in text, text
            else:  # loaded: its score head is the trained one the files hold, of one row
                from safetensors.torch import load_file

                saved = load_file(reward_dir / "model.safetensors")["score.weight"]
                assert torch.equal(model.score.weight.detach(), saved), damage
            recipe = grpo_recipe(Path(tmp) / "run", rewards=[{"model": str(rm)}])
            code, message = _cli(["compile", str(recipe), "--out", str(Path(tmp) / "out")])
            assert code in (0, 2), (code, message[-3000:])
            if code == 2:
                assert "rewards[0].model" in _one_paragraph("compile", message), message
        assert asked == [], asked


@pytest.mark.timeout(180)
@settings(DEFAULT, max_examples=25)
@given(damage=damages)
def test_fuzzed_reward_model_dirs(reward_dir, damage):
    _check_reward_dir(reward_dir, damage)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(SLOW, max_examples=150)
@given(damage=damages)
def test_fuzzed_reward_model_dirs_many(reward_dir, damage):
    _check_reward_dir(reward_dir, damage)


def test_the_harness_sees_a_refusal_and_an_acceptance(tiny_dir, reward_dir):
    """The properties bite: a bad field is refused naming it, a good config and a good dir pass."""
    good = ("dir", dict(TINY_LLAMA), {})
    _check_config(tiny_dir, good, "plan")
    with pytest.raises(AssertionError):  # a run accepting hidden_size 10**12 fails the property
        with mock.patch("llmft.plan.shape.config_problems", lambda cfg, source, **kw: []):
            with mock.patch("llmft.model.source.check_config", lambda cfg, source, **kw: None):
                _check_config(tiny_dir, ("dir", {**TINY_LLAMA, "hidden_size": 10**12}, {"hidden_size": 10**12}), "plan")
    _check_reward_dir(reward_dir, ("none",))
    _check_reward_dir(reward_dir, ("no-head",))
