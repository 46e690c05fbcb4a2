"""A model config whose sizes cannot be a model's is refused from its arithmetic, before anything is
allocated (``llmft.plan.shape.check_config``, bounds in ``llmft.limits``).

A typo in a model directory's ``config.json`` (``model.name_or_path``), in a Hugging Face cache
snapshot, or in the recipe's ``model.config`` (hidden_size 10**12, 0 heads, "64", 64.0, heads that do
not divide, sizes that make 10**17 parameters) is one message naming the field and the file (or the
recipe key) and how to fix it, from ``llmft plan``, ``compile``, ``train``, ``verify`` and every
build of a model (the policy, a reference model, export's rebuild of the base); never a traceback
nor an attempt to allocate it. Every test runs under ``guard``: a torch factory asked for more than
2**26 elements records it and raises, so the unchanged code's attempts show.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import TINY_LLAMA, pretrained_model, save_tiny_pretrained, write_recipe

from llmft.cli import main
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.model.build import build_model, load_base_model
from llmft.recipe import load_recipe

HUGE = 2**26  # elements: far more than any tensor of these tests' models (the tiny one's largest has 20480)

SIZE_FIX = "Set it to a whole number in [1, 16,777,216] (published models' values are far below the top)."
ABOVE = "above the 16,777,216 llmft accepts for a size (a typo?)"
LAYERS_FIX = "Set it to a whole number in [1, 16,384] (published models' values are far below the top)."
# (field, value, what the message says of it, its fix)
CASES = [
    ("hidden_size", 10**12, f"is 1000000000000, {ABOVE}", SIZE_FIX),
    ("vocab_size", 10**15, f"is about 10**15, {ABOVE}", SIZE_FIX),
    ("num_hidden_layers", 10**9, "is 1000000000, above the 16,384 llmft accepts for a size (a typo?)", LAYERS_FIX),
    ("intermediate_size", 10**12, f"is 1000000000000, {ABOVE}", SIZE_FIX),
    # found by the fuzzing harness: transformers builds per-layer lists with the config (51 s for these)
    ("num_hidden_layers", 2**24 - 1, "is 16777215, above the 16,384 llmft accepts for a size (a typo?)", LAYERS_FIX),
    ("num_attention_heads", 0, "is 0, below 1", SIZE_FIX),
    ("hidden_size", -64, "is -64, below 1", SIZE_FIX),
    ("head_dim", -1, "is -1, below 1", SIZE_FIX),
    ("hidden_size", 64.0, "is 64.0, not a whole number", "Write it without a decimal point: 64."),
    ("num_hidden_layers", "2", 'is "2", not a whole number', LAYERS_FIX),
    ("intermediate_size", None, "is null", SIZE_FIX),
    ("vocab_size", [320], "is [320], not a whole number", SIZE_FIX),
    ("num_hidden_layers", True, "is true, not a whole number", LAYERS_FIX),
    (
        "num_key_value_heads",
        3,
        "is 3, which does not divide num_attention_heads 4: each key/value head serves a whole number of "
        "attention heads",
        "Use a divisor of 4: 1, 2, 4.",
    ),
]
IDS = [f"{f}={v!r}"[:40] for f, v, _, _ in CASES]
# Each size within the per-field bound, together more than 1e17 parameters.
BIG = {"hidden_size": 2**20, "num_hidden_layers": 2**14, "intermediate_size": 2**20}
BIG_FIX = "One of these fields has a typo: correct it (the largest published models have about 2e12 parameters)."
BIG_IN_RECIPE = (
    "the sizes hidden_size 1,048,576, num_hidden_layers 16,384, num_attention_heads 4, intermediate_size "
    "1,048,576, num_key_value_heads 2, vocab_size 320, max_position_embeddings 256 make up to 1.6e+17 "
    "parameters (3.2e+05 TB in bf16), above the 1e+13 llmft accepts: more than any machine holds"
)
BIG_IN_DIR = (  # save_pretrained writes head_dim: the heads keep 16 features each
    "the sizes hidden_size 1,048,576, num_hidden_layers 16,384, num_attention_heads 4, intermediate_size "
    "1,048,576, num_key_value_heads 2, head_dim 16, vocab_size 320, max_position_embeddings 256 make up to "
    "1.1e+17 parameters (2.2e+05 TB in bf16), above the 1e+13 llmft accepts: more than any machine holds"
)


@pytest.fixture(autouse=True)
def guard(monkeypatch):
    """Every torch factory (and nn.Linear / nn.Embedding through them) refuses more than HUGE elements;
    what was asked is recorded."""
    asked: list[tuple[str, int]] = []
    for name in ("empty", "zeros", "ones", "full", "rand", "randn", "empty_strided"):
        real = getattr(torch, name)

        def factory(*args, _real=real, _name=name, **kwargs):
            size = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else args
            dims = [int(d) for d in size if isinstance(d, int)] if isinstance(size, (tuple, list, torch.Size)) else []
            numel = math.prod(dims) if dims else 0
            if numel > HUGE or any(d < 0 for d in dims):
                asked.append((_name, numel))
                raise MemoryError(f"test guard: torch.{_name} of {numel} elements")
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, factory)
    yield asked
    assert asked == [], f"allocation attempted: {asked}"


def _model_dir(tmp_path: Path, **config) -> Path:
    """A tiny pretrained llama dir whose config.json then gets ``config``'s fields (None: removed)."""
    d = save_tiny_pretrained(tmp_path / "hf", seed=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _cli(*argv: str) -> tuple[int, str]:
    """``llmft ARGV`` in process; ``train`` stops where it would start the process group (exit 0 there)."""
    err = io.StringIO()

    class Reached(Exception):
        pass

    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        mock.patch("llmft.training.train.init_distributed", side_effect=Reached),
    ):
        try:
            code = main(list(argv))
        except Reached:
            code = 0
    return code, err.getvalue()


def _refused(command: str, recipe: Path, where: str, what: str, fix: str, *extra: str) -> None:
    code, err = _cli(command, str(recipe), *extra)
    assert (code, err.strip()) == (2, f"llmft {command}: error: {where}: {what}. {fix}"), err[-3000:]


@pytest.mark.parametrize(("field", "value", "what", "fix"), CASES, ids=IDS)
def test_a_model_dirs_config_is_refused_by_plan_train_and_verify_naming_file_and_field(
    tmp_path, field, value, what, fix
):
    d = _model_dir(tmp_path, **{field: value})
    recipe = write_recipe(tmp_path, model=pretrained_model(d))
    for command in ("plan", "train", "verify"):
        _refused(command, recipe, str(d / "config.json"), f"{field} {what}", fix)


@pytest.mark.parametrize(("field", "value", "what", "fix"), CASES, ids=IDS)
def test_a_recipes_model_config_is_refused_by_plan_compile_and_train_naming_the_key(tmp_path, field, value, what, fix):
    recipe = write_recipe(tmp_path, model__config={**TINY_LLAMA, field: value})
    for command in ("plan", "train"):
        _refused(command, recipe, f"model.config.{field}", what, fix)
    _refused("compile", recipe, f"model.config.{field}", what, fix, "--out", str(tmp_path / "out"))


def test_sizes_that_make_more_parameters_than_any_machine_holds(tmp_path):
    d = _model_dir(tmp_path, **BIG)
    recipe = write_recipe(tmp_path, model=pretrained_model(d))
    _refused("plan", recipe, str(d / "config.json"), BIG_IN_DIR, BIG_FIX)
    recipe = write_recipe(tmp_path / "fresh", model__config={**TINY_LLAMA, **BIG})
    _refused("compile", recipe, "model.config", BIG_IN_RECIPE, BIG_FIX, "--out", str(tmp_path / "out"))


def test_a_config_that_describes_far_more_than_its_weights(tmp_path):
    """Each size within bounds, but 2**24 for intermediate_size in a 460 KB model: building it would
    allocate 26 GB before the weights' shapes disagree. Refused from the weight files' sizes."""
    d = _model_dir(tmp_path, intermediate_size=2**24)
    stored = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    message = (
        f"{d / 'config.json'}: describes at least 4.3e+09 parameters, but the weight files beside it hold "
        f"{stored:,} bytes (more than 16 parameters a byte): a size has a typo, or the config is another "
        "model's. Use the config.json saved with these weights (save_pretrained writes both), or correct the size."
    )
    recipe = write_recipe(tmp_path, model=pretrained_model(d))
    for command in ("plan", "train", "verify"):
        code, err = _cli(command, str(recipe))
        assert (code, err.strip()) == (2, f"llmft {command}: error: {message}"), err[-2000:]
    assert _build_refused(load_recipe(recipe)) == message


def test_a_config_whose_family_defaults_describe_another_model(tmp_path):
    """Found by the fuzzing harness: a config.json of only ``model_type: llama`` takes the family's
    defaults (hidden 4096, 32 layers: a 7B model) for a 460 KB model; the defaults are checked against
    the weight files too, before the model is built."""
    d = save_tiny_pretrained(tmp_path / "hf", seed=1)
    (d / "config.json").write_text('{"model_type": "llama"}')
    stored = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert _build_refused(load_recipe(write_recipe(tmp_path, model=pretrained_model(d)))) == (
        f"{d / 'config.json'}: describes at least 3.6e+09 parameters, but the weight files beside it hold "
        f"{stored:,} bytes (more than 16 parameters a byte): a size has a typo, or the config is another "
        "model's. Use the config.json saved with these weights (save_pretrained writes both), or correct the size."
    )


def _build_refused(recipe) -> str:
    with pytest.raises(UserError) as e:
        build_model(recipe, byte_tokenizer())
    return str(e.value)


def test_every_build_checks_the_config_first(tmp_path):
    """The build itself (what the engines, a reference model, export and verify call), also when the
    recipe checks were skipped: the model.config, a model dir, on the meta device (export), the base
    export rebuilds, and a reference model's dir."""
    bad = load_recipe(write_recipe(tmp_path / "fresh", model__config={**TINY_LLAMA, "hidden_size": 10**12}))
    key = f"model.config.hidden_size: is 1000000000000, {ABOVE}. {SIZE_FIX}"
    assert _build_refused(bad) == key
    with pytest.raises(UserError) as e:
        load_base_model(bad)  # export's rebuild of a model.config base
    assert str(e.value) == key

    d = _model_dir(tmp_path, vocab_size=10**15)
    in_dir = f"{d / 'config.json'}: vocab_size is about 10**15, {ABOVE}. {SIZE_FIX}"
    from_dir = load_recipe(write_recipe(tmp_path / "dir", model=pretrained_model(d)))
    assert _build_refused(from_dir) == in_dir
    with pytest.raises(UserError) as e:  # export of a full fine-tune builds it on the meta device
        build_model(from_dir, byte_tokenizer(), init_context=lambda: torch.device("meta"))
    assert str(e.value) == in_dir

    from llmft.plan.resolve import resolve

    good = resolve(load_recipe(write_recipe(tmp_path / "dpo", model__config=TINY_LLAMA)))
    assert _build_refused(good.frozen_model_plan(str(d)).recipe) == in_dir  # a reference model's dir


def test_a_hub_cache_snapshot_is_checked_too(tmp_path, monkeypatch):
    """A hub id read from the Hugging Face cache (offline): its snapshot's config.json is named."""
    hub = tmp_path / "hub"
    snapshot = hub / "models--llmft-test--tiny" / "snapshots" / "abc"
    shutil.copytree(save_tiny_pretrained(tmp_path / "hf", seed=1), snapshot)
    (hub / "models--llmft-test--tiny" / "refs").mkdir()
    (hub / "models--llmft-test--tiny" / "refs" / "main").write_text("abc")
    cfg = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**9}))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("transformers.utils.hub.HF_HUB_CACHE", str(hub), raising=False)
    message = f"{snapshot / 'config.json'}: num_hidden_layers is 1000000000, above the 16,384 llmft accepts for a size (a typo?). {LAYERS_FIX}"
    recipe = write_recipe(tmp_path, model={**pretrained_model(snapshot), "name_or_path": "llmft-test/tiny"})
    code, err = _cli("plan", str(recipe))
    assert (code, err.strip()) == (2, f"llmft plan: error: {message}")
    assert _build_refused(load_recipe(recipe)) == message


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("[1, 2]", "is a JSON list, not an object of config fields"),
        ("7", "is a JSON int, not an object of config fields"),
        ('{"a": ' * 40 + "1" + "}" * 40, "a nests objects or lists more than 32 levels deep"),
        (
            '{"hidden_size": ' + "[" * 3000 + "]" * 3000 + "}",
            "hidden_size nests objects or lists more than 32 levels deep",
        ),
        ("[" * 5000 + "]" * 5000, "nests objects or lists more than 32 levels deep"),
        ('{"hidden_size": 1' + "0" * 5000 + "}", "hidden_size is a number of 5001 digits, above 16,777,216"),
    ],
    ids=["list", "scalar", "deep", "deep-field", "very-deep", "5000-digits"],
)
def test_a_config_json_that_cannot_be_a_config(tmp_path, text, what):
    d = save_tiny_pretrained(tmp_path / "hf", seed=1)
    (d / "config.json").write_text(text)
    recipe = write_recipe(tmp_path, model=pretrained_model(d))
    for command in ("plan", "train"):
        code, err = _cli(command, str(recipe))
        assert code == 2 and err.startswith(f"llmft {command}: error: {d / 'config.json'}: {what}"), err[-2000:]
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _build_refused(load_recipe(recipe)).startswith(f"{d / 'config.json'}: {what}")


def test_a_config_json_too_large_to_be_one(tmp_path, monkeypatch):
    d = _model_dir(tmp_path)
    monkeypatch.setattr("llmft.limits.CONFIG_MAX_BYTES", 100)
    size = (d / "config.json").stat().st_size
    recipe = write_recipe(tmp_path, model=pretrained_model(d))
    code, err = _cli("plan", str(recipe))
    assert (code, err.strip()) == (
        2,
        f"llmft plan: error: {d / 'config.json'}: is {size:,} bytes, above the 100 a model config may have. "
        "A model's config.json is a few KB: check that this is the model's config (save_pretrained writes it).",
    )


def test_transformers_own_validation_is_a_message_naming_the_file(tmp_path):
    """A config the bounds accept but transformers' strict validation refuses (heads that do not split
    hidden_size, head_dim given): the file and transformers' reason, not its traceback."""
    d = _model_dir(tmp_path, hidden_size=66)  # head_dim 16 stays: llmft's divisibility rule defers
    message = _build_refused(load_recipe(write_recipe(tmp_path, model=pretrained_model(d))))
    assert message.startswith(
        f"{d / 'config.json'}: transformers refuses this config (StrictDataclassClassValidationError: "
    )
    assert "66" in message and message.endswith(
        "Fix the field the message names (compare it with the model's published config.json)."
    )


PUBLISHED = {  # the largest sizes of published models: accepted
    "llama-3.1-405b": dict(
        model_type="llama",
        hidden_size=16384,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        vocab_size=129280,
        max_position_embeddings=163840,
    ),
    "gemma-3-27b": dict(
        model_type="gemma3",
        text_config=dict(
            hidden_size=5376,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            intermediate_size=21504,
            vocab_size=262208,
        ),
    ),
    "llama-4-scout": dict(
        model_type="llama4",
        text_config=dict(
            hidden_size=5120,
            num_hidden_layers=48,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=8192,
            num_local_experts=16,
            vocab_size=202048,
            max_position_embeddings=10485760,
        ),
    ),
    "gpt2": dict(
        model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_inner=None, n_positions=1024, vocab_size=50257
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_pass(name):
    from llmft.plan.shape import KNOWN, config_problems

    assert config_problems(PUBLISHED[name], "model.config") == []
    assert all(config_problems(cfg, "model.config") == [] for cfg in KNOWN.values())
