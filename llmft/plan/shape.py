"""The shape of a model (sizes that memory, FLOPs and bucket sizes depend on), read without torch.

From ``model.config`` in the recipe, a local ``config.json``, the HF cache, or a
small table of well-known hub models, so that ``llmft compile`` and ``llmft plan``
work on a laptop with nothing downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmft.errors import Problem, UserError

# Published configs of common base models (hidden, layers, heads, kv heads, intermediate, vocab, tied).
KNOWN: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "meta-llama/Llama-3.1-70B": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    # The model of PEFT's FSDP+QLoRA and ZeRO-3+QLoRA memory anchors (docs/benchmarks.md).
    "meta-llama/Llama-2-70b-hf": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
    ),
    "meta-llama/Llama-3.2-1B": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "meta-llama/Llama-3.2-3B": dict(
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-7B": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
    ),
    "mistralai/Mistral-7B-v0.3": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32768,
    ),
}
for _base in list(KNOWN):
    KNOWN[_base + "-Instruct"] = KNOWN[_base]
KNOWN["meta-llama/Meta-Llama-3.1-8B-Instruct"] = KNOWN["meta-llama/Llama-3.1-8B"]
KNOWN["meta-llama/Meta-Llama-3.1-70B-Instruct"] = KNOWN["meta-llama/Llama-3.1-70B"]


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_linear_params(self) -> int:
        """Weights of the linear layers of one decoder layer (``linear_shapes``)."""
        return sum(i * o for i, o in linear_shapes(self).values())

    @property
    def embedding_params(self) -> int:
        """The input embedding, plus the LM head unless it is tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_params(self) -> int:
        """Parameters of a Llama-style decoder: layers (linears + two RMSNorms), embedding
        (+ untied head), final norm."""
        h = self.hidden_size
        return self.num_layers * (self.layer_linear_params + 2 * h) + self.embedding_params + h

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every decoder linear plus the LM head
        (a matmul even when tied). The embedding is a lookup and norms are negligible."""
        return self.num_layers * self.layer_linear_params + self.vocab_size * self.hidden_size

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or cfg["d_model"])
        heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
        return cls(
            hidden_size=hidden,
            num_layers=int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 1),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden),
            vocab_size=int(cfg.get("vocab_size", 32000)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one Llama-style decoder layer:
    attention with grouped-query k/v, SwiGLU MLP. The one place this arithmetic lives."""
    h, kv, i = shape.hidden_size, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    return {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _hub_cache_config(repo_id: str) -> Path | None:
    home = Path(
        os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface")) / "hub"
    )
    snapshots = home / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir():
        for snap in sorted(snapshots.iterdir(), reverse=True):
            if (snap / "config.json").is_file():
                return snap / "config.json"
    return None


def model_shape(model_cfg: Any) -> ModelShape | None:
    """Shape of ``recipe.model``, or None when it cannot be known without a download."""
    if model_cfg.config is not None:
        try:
            return ModelShape.from_config(dict(model_cfg.config))
        except KeyError:
            what = "has no hidden_size (nor n_embd or d_model)"
        except (ValueError, TypeError) as e:
            what = f"has a size that is not a whole number ({e})"
        fix = "Give hidden_size, num_hidden_layers, num_attention_heads and intermediate_size as whole numbers."
        raise UserError(Problem("model.config", what, fix))
    name = model_cfg.name_or_path
    if name is None:
        return None
    local = Path(name) / "config.json"
    path = local if local.is_file() else _hub_cache_config(name)
    if path is not None:
        try:
            return ModelShape.from_config(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            return None
    if name in KNOWN:
        return ModelShape.from_config(KNOWN[name])
    return None
