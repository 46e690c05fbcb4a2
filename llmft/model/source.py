"""Where a model comes from: its Hugging Face config (from ``model.config`` fields, or read from
``model.name_or_path``), that name resolved to a local directory or a hub id, and the ``UserError``s of
finding and loading it (a missing directory, an offline hub, remote code not trusted, an attention
kernel that is not installed), each naming the recipe key. Every config is checked
(``llmft.plan.shape.check_config``: its sizes bounded, named by field) before a model is built from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig
from transformers.utils import CONFIG_NAME, cached_file

from llmft.errors import OTHER, PACKAGE, Problem, UserError, cause_kind, cause_of, first_line, library_problem
from llmft.plan.shape import check_config, check_config_file, weights_problems

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from llmft.recipe.schema import ModelConfig


def model_config(m: ModelConfig) -> PretrainedConfig:
    """The HF config: from ``model.config`` fields, or read from ``model.name_or_path``."""
    if m.config is not None:
        fields = dict(m.config)
        check_config(fields, "model.config")  # before transformers builds (or allocates) anything of it
        try:
            return AutoConfig.for_model(**fields)
        except Exception as e:  # transformers raises ValueError, KeyError or hub's StrictDataclassError
            raise UserError(
                Problem(
                    "model.config",
                    f"is not a valid {fields.get('model_type')!r} config: {first_line(e)}",
                    "Fix the field named in the message (model_type must be a transformers model type, e.g. llama).",
                )
            ) from None
    name = resolve_name(m.name_or_path)
    with load_errors(m, name):  # a hub id's config.json: fetched (or found in the cache) as AutoConfig would
        found = Path(name) / CONFIG_NAME if Path(name).is_dir() else cached_file(name, CONFIG_NAME, revision=m.revision)
    path = Path(found) if found is not None else Path(name)
    if found is not None:
        check_config_file(path)  # before transformers builds (or allocates) anything of it
    try:
        config = AutoConfig.from_pretrained(name, revision=m.revision, trust_remote_code=m.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - what AutoConfig refuses in a config has no common base
        error = load_error(m, name, e)
        if error is None:  # transformers' own validation of the fields (StrictDataclassError, ...)
            error = UserError(
                Problem(
                    str(path),
                    f"transformers refuses this config ({cause_of(e)})",
                    "Fix the field the message names (compare it with the model's published config.json).",
                )
            )
        raise error from None
    if found is not None:  # with the family's defaults filled in: sizes the file left out count too
        problems = weights_problems(config.to_dict(), path)
        if problems:
            raise UserError(*problems)
    return config


@contextlib.contextmanager
def load_errors(m: ModelConfig, name: str) -> Iterator[None]:
    """A failed config or model load of ``name`` raised as its ``UserError`` (``load_error``); an
    error that is no known cause (a bug) propagates as it is."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - hub, json and transformers errors share no base; bugs re-raised
        error = load_error(m, name, e)
        if error is None:
            raise
        raise error from None


def resolve_name(name: str | None) -> str:
    """A local directory (checked here) or a hub id (checked by the hub)."""
    assert name is not None, "validate() guarantees name_or_path or config"
    path = Path(name).expanduser()
    if not (name.startswith((".", "/", "~")) or path.exists()):
        return name
    if not path.is_dir():
        raise UserError(
            Problem(
                "model.name_or_path",
                f"directory '{name}' does not exist",
                "Check the path, or give a Hugging Face hub id such as meta-llama/Llama-3.1-8B.",
            )
        )
    if not (path / "config.json").is_file():
        raise UserError(
            Problem(
                "model.name_or_path",
                f"'{name}' has no config.json, so it is not a Hugging Face model directory",
                "Point it at a directory written by save_pretrained (config.json + *.safetensors).",
            )
        )
    return str(path)


def load_error(m: ModelConfig, name: str, e: Exception) -> UserError | None:
    """The ``UserError`` of a failed config or model load, naming the cause (``llmft.errors``) and its
    fix; None for an error that is no known cause and no library's load error (a bug: re-raised)."""
    kind = cause_kind(e)
    if isinstance(e, ImportError) and m.attn_implementation.split("_")[0] in str(e).lower():
        return attn_unavailable(m, e)
    if "trust_remote_code" in str(e):
        return UserError(
            Problem(
                "model.trust_remote_code",
                f"'{name}' ships its own model code, which llmft does not run unless asked",
                "Read that code, then set model.trust_remote_code=true if you trust it.",
            )
        )
    if kind == PACKAGE and m.quantization is not None and "bitsandbytes" in str(e):
        return UserError(library_problem("model.quantization", "needs bitsandbytes", e))
    if kind == OTHER and not isinstance(e, (OSError, ValueError, ImportError)):
        return None
    local = Path(name).is_dir()
    rev = f" at revision {m.revision}" if m.revision else ""
    doing = f"cannot load '{name}'{rev}" if local else f"'{name}'{rev} is not a local directory and does not load"
    fix = (
        "Check that the directory holds what save_pretrained writes (config.json, *.safetensors)."
        if local
        else f"Check the id and model.revision, download it once with network access (`hf download {name}`), "
        "or point model.name_or_path at a local model directory."
    )
    return UserError(library_problem("model.name_or_path", doing, e, name=name, local=local, fix=fix))


def attn_unavailable(m: ModelConfig, e: ImportError) -> UserError:
    return UserError(
        Problem(
            "model.attn_implementation",
            f"{m.attn_implementation} cannot be used here ({cause_of(e)})",
            "Set model.attn_implementation=sdpa (works everywhere), or install the kernel it needs.",
        )
    )
