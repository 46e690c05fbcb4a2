"""A wrapped library error keeps its cause and gives the fix for that cause (``llmft.errors.cause_fix``).

Each cause is produced for real on the CPU: an offline hub id not in an empty cache, a model directory
whose model_type transformers does not know, a truncated safetensors file, a config.json cut short, a
package reported missing (transformers' own availability check, patched), and hub kernels asked for
without the ``kernels`` package."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers.modeling_utils as hf_modeling
import transformers.quantizers.quantizer_bnb_4bit as hf_bnb4
import yaml
from helpers import TINY_LLAMA, save_tiny_pretrained

from llmft.data.tokenizer import byte_tokenizer, load_tokenizer
from llmft.errors import ARCHITECTURE, DAMAGED, HUB_KERNELS, OFFLINE, OTHER, PACKAGE, UserError, cause_kind
from llmft.model.build import build_model
from llmft.recipe import load_recipe


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("load-errors") / "tiny", seed=0)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))


def _recipe(tmp_path, **model):
    data = {
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"dtype": "fp32", "attn_implementation": "eager", **model},
        "peft": {"method": "lora" if "quantization" in model else "none", "r": 4},
        "data": {"train": str(tmp_path / "train.jsonl")},
        "batch": {"global_batch_size": 2, "micro_batch_size": 2},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path)


def _load_error(tmp_path, **model) -> str:
    with pytest.raises(UserError) as e:
        build_model(_recipe(tmp_path, **model), byte_tokenizer())
    return str(e.value)


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "model")


def test_offline_and_not_in_the_cache(tmp_path, offline):
    msg = _load_error(tmp_path, name_or_path="llmft-test/not-cached")
    assert msg == (
        "model.name_or_path: 'llmft-test/not-cached' is not a local directory and does not load (OSError: We "
        "couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cached "
        "files.). 'llmft-test/not-cached' is not in the local Hugging Face cache (HF_HOME) and downloads are off "
        "(HF_HUB_OFFLINE=1): download it once on a machine with network access (`hf download "
        "llmft-test/not-cached`) into the HF_HOME this job uses, or point at a local directory (docs/offline.md)."
    )
    assert "Use a causal language model" not in msg
    with pytest.raises(UserError) as e:  # the tokenizer, loaded first by a run, says the same
        load_tokenizer(_recipe(tmp_path, name_or_path="llmft-test/not-cached").model)
    assert str(e.value).startswith("model.name_or_path: no tokenizer could be loaded from 'llmft-test/not-cached' (")
    assert "downloads are off (HF_HUB_OFFLINE=1)" in str(e.value)


def test_unknown_model_type(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "llmft-unknown"}))
    msg = _load_error(tmp_path, name_or_path=str(tmp_path / "model"))
    version = transformers_version()
    assert msg.startswith(
        f"model.name_or_path: cannot load '{tmp_path / 'model'}' (ValueError: The checkpoint you are trying to "
        "load has model type `llmft-unknown` but Transformers does not recognize this architecture."
    )
    assert msg.endswith(
        f"This transformers ({version}) does not know the model_type of '{tmp_path / 'model'}' (config.json): "
        "upgrade it (`pip install -U transformers`) if the model is newer, or use a model whose model_type it "
        "supports."
    )


def test_truncated_safetensors(tmp_path, saved):
    model = _copy(saved, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert _load_error(tmp_path, name_or_path=str(model)) == (
        f"model.name_or_path: cannot load '{model}' (SafetensorError: Error while deserializing header: incomplete "
        f"metadata, file not fully covered). A file of '{model}' is damaged or incomplete (an interrupted download, "
        "copy or save): copy or save it again (save_pretrained)."
    )


def test_config_cut_short(tmp_path, saved):
    model = _copy(saved, tmp_path)
    (model / "config.json").write_text('{"model_type": "llama", ')
    assert _load_error(tmp_path, name_or_path=str(model)) == (
        f"model.name_or_path: cannot load '{model}' (OSError: It looks like the config file at "
        f"'{model / 'config.json'}' is not a valid JSON file.). A file of '{model}' is damaged or incomplete (an "
        "interrupted download, copy or save): copy or save it again (save_pretrained)."
    )


def test_missing_package(tmp_path, saved, monkeypatch):
    monkeypatch.setattr(hf_bnb4, "is_bitsandbytes_available", lambda *a, **k: False)
    msg = _load_error(tmp_path, name_or_path=str(saved), quantization={"bits": 4})
    assert msg.startswith(
        "model.quantization: needs bitsandbytes (ImportError: Using `bitsandbytes` 4-bit quantization requires "
        "bitsandbytes: `pip install -U bitsandbytes>="
    )
    assert msg.endswith('Install the missing package in this environment: `pip install "bitsandbytes>=0.46.1"`.')


def test_hub_kernels_without_the_kernels_package(tmp_path, saved, monkeypatch):
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    monkeypatch.setattr(hf_modeling, "is_kernels_available", lambda: False)
    msg = _load_error(tmp_path, name_or_path=str(saved), hub_kernels=True)
    assert msg.startswith(f"model.name_or_path: cannot load '{saved}' (ValueError: Kernels are not available.")
    assert msg.endswith(
        "transformers was asked to replace layers by compiled kernels from the Hugging Face Hub "
        "(model.hub_kernels=true): set model.hub_kernels=false (the default), or install the `kernels` package "
        "and run once with network access so that the kernels are in the HF cache."
    )


@pytest.mark.parametrize(
    "error, kind",
    [
        # the load error of the H200 runs (docs/offline.md): Hub kernels, whatever else the text says
        (
            ValueError(
                "Version 2 of 'kernels-community/rotary' is not available in the local cache and Hugging Face Hub "
                "is in offline mode"
            ),
            HUB_KERNELS,
        ),
        (ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn"), PACKAGE),
        (json.JSONDecodeError("Expecting value", "{", 1), DAMAGED),
        (OSError("Couldn't reach 'org/x' on the Hub (OfflineModeIsEnabled)"), OFFLINE),
        (ValueError("Unrecognized configuration class <class 'X'> for this kind of AutoModel"), ARCHITECTURE),
        (RuntimeError("size mismatch for weight"), OTHER),
    ],
)
def test_cause_kind(error, kind):
    assert cause_kind(error) == kind


def test_the_cause_is_found_along_the_chain():
    try:
        try:
            torch.load(__file__, weights_only=True)
        except Exception as inner:
            raise OSError("Unable to load weights") from inner
    except OSError as outer:
        assert cause_kind(outer) == DAMAGED  # UnpicklingError, two levels down


def transformers_version() -> str:
    import transformers

    return transformers.__version__
