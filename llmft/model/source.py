"""Where a model comes from: its Hugging Face config (from ``model.config`` fields, or read from
``model.name_or_path``), that name resolved to a local directory or a hub id, and the ``UserError``s of
finding and loading it (a missing directory, an offline hub, remote code not trusted, an attention
kernel that is not installed), each naming the recipe key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import constants
from transformers import AutoConfig

from llmft.errors import Problem, UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from llmft.recipe.schema import ModelConfig


def model_config(m: ModelConfig) -> PretrainedConfig:
    """The HF config: from ``model.config`` fields, or read from ``model.name_or_path``."""
    if m.config is not None:
        fields = dict(m.config)
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
    try:
        return AutoConfig.from_pretrained(name, revision=m.revision, trust_remote_code=m.trust_remote_code)
    except OSError as e:
        raise not_found(m, name, e) from None
    except ValueError as e:
        raise bad_pretrained(m, name, e) from None


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


def not_found(m: ModelConfig, name: str, e: Exception) -> UserError:
    offline = constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    where = "the local Hugging Face cache (HF_HUB_OFFLINE=1: no downloads)" if offline else "the Hugging Face hub"
    rev = f" at revision {m.revision}" if m.revision else ""
    return UserError(
        Problem(
            "model.name_or_path",
            f"'{name}'{rev} is not a local directory and is not in {where}: {first_line(e)}",
            f"Download it once with network access (`hf download {name}`) so it is cached in HF_HOME, "
            "point model.name_or_path at a local model directory, or check the id and model.revision "
            "(gated models also need `hf auth login`).",
        )
    )


def bad_pretrained(m: ModelConfig, name: str, e: Exception) -> UserError:
    if "trust_remote_code" in str(e):
        return UserError(
            Problem(
                "model.trust_remote_code",
                f"'{name}' ships its own model code, which llmft does not run unless asked",
                "Read that code, then set model.trust_remote_code=true if you trust it.",
            )
        )
    return UserError(
        Problem(
            "model.name_or_path",
            f"cannot load '{name}': {first_line(e)}",
            "Use a causal language model that this transformers version supports.",
        )
    )


def attn_unavailable(m: ModelConfig, e: ImportError) -> UserError:
    return UserError(
        Problem(
            "model.attn_implementation",
            f"{m.attn_implementation} cannot be used here: {first_line(e)}",
            "Set model.attn_implementation=sdpa (works everywhere), or install the kernel it needs.",
        )
    )


def first_line(e: Exception) -> str:
    """The gist of a library error; a first line that only introduces the next one keeps both."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]
