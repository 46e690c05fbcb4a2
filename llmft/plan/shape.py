"""The shape of a model (sizes that memory, FLOPs and bucket sizes depend on), read without torch.

From ``model.config`` in the recipe, a local ``config.json``, the HF cache, or a
small table of well-known hub models, so that ``llmft compile`` and ``llmft plan``
work on a laptop with nothing downloaded.

Every config read here, and every one a model is built from (``llmft.model.source``), is checked
first (``check_config``): each size field a whole number within ``llmft.limits``, the heads
dividing what they split, and the parameters the sizes make within ``MODEL_PARAMS_MAX``; so that
a typo is a message naming the field and the file (or recipe key), never an allocation of
exabytes. ``reward_model_problems`` reads a reward model directory the same way (its config and
its safetensors headers): a directory with no trained score head is refused before anything loads.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmft import limits
from llmft.errors import Problem, UserError
from llmft.plan.moe import Experts, experts_of

# Published configs of common base models (hidden, layers, heads, kv heads, intermediate, vocab, tied;
# head_dim and the routing fields where the model has them).
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
# Mixtures of experts (their config.json's size and routing fields; docs/moe.md, "Planning").
KNOWN["Qwen/Qwen3-30B-A3B"] = dict(
    model_type="qwen3_moe",
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
)
KNOWN["openai/gpt-oss-20b"] = dict(
    model_type="gpt_oss",
    hidden_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=2880,
    num_local_experts=32,
    num_experts_per_tok=4,
    vocab_size=201088,
)
KNOWN["meta-llama/Meta-Llama-3.1-70B-Instruct"] = KNOWN["meta-llama/Llama-3.1-70B"]


# Families whose attention normalises each head's queries and keys (q_norm, k_norm: head_dim weights each).
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int  # a dense MLP's width
    vocab_size: int
    tie_word_embeddings: bool = False
    head_size: int = 0  # the config's head_dim where it gives one; 0: hidden_size / num_heads
    qk_norm: bool = False  # q_norm and k_norm in every layer's attention (QK_NORM_TYPES)
    experts: Experts | None = None  # a mixture of experts' routed experts; None: dense

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def mlp_width(self) -> int:
        """The width of the MLP built of ``nn.Linear`` layers in a typical layer (``linear_shapes``):
        the dense MLP's; in a mixture of experts the shared expert's (0 where it has none and every
        layer is routed: its experts are fused ``[experts, ., .]`` tensors, not linears)."""
        e = self.experts
        if e is None:
            return self.intermediate_size
        return e.shared_ffn or (self.intermediate_size if e.num_layers < self.num_layers else 0)

    @property
    def mlp_width_per_token(self) -> int:
        """The MLP width one token goes through, averaged over the layers (its activations): the dense
        MLP's, or in a routed layer K experts' and the shared expert's."""
        e = self.experts
        if e is None:
            return self.intermediate_size
        dense = (self.num_layers - e.num_layers) * self.intermediate_size
        return (dense + e.num_layers * (e.top_k * e.ffn + e.shared_ffn)) // self.num_layers

    @property
    def layer_linear_params(self) -> int:
        """Weights of the linear layers of one decoder layer (``linear_shapes``)."""
        return sum(i * o for i, o in linear_shapes(self).values())

    @property
    def linear_params(self) -> int:
        """Weights of every ``nn.Linear`` of the decoder layers (what 4-bit quantization applies to):
        attention, dense MLPs, shared experts and their gates; not the routed experts nor the router."""
        h, e = self.hidden_size, self.experts
        attention = sum(i * o for name, (i, o) in linear_shapes(self).items() if name not in _MLP)
        if e is None:
            return self.num_layers * self.layer_linear_params
        dense = (self.num_layers - e.num_layers) * 3 * h * self.intermediate_size
        return self.num_layers * attention + dense + e.num_layers * (3 * h * e.shared_ffn + h * e.shared_gate)

    @property
    def expert_params(self) -> int:
        """The routed experts' weights (fused ``[experts, ., .]`` tensors), all layers; 0 when dense."""
        e = self.experts
        return e.num_layers * e.num_experts * 3 * self.hidden_size * e.ffn if e else 0

    @property
    def router_params(self) -> int:
        """The routers' weights (hidden x experts per MoE layer); 0 when dense."""
        e = self.experts
        return e.num_layers * self.hidden_size * e.num_experts if e else 0

    @property
    def embedding_params(self) -> int:
        """The input embedding, plus the LM head unless it is tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def norm_params(self) -> int:
        """Two RMSNorms per layer (and q/k norms where the family has them), and the final norm."""
        qk = 2 * self.head_dim if self.qk_norm else 0
        return self.num_layers * (2 * self.hidden_size + qk) + self.hidden_size

    @property
    def num_params(self) -> int:
        """Parameters of a Llama-style decoder (total, every expert): layers (linears, routed experts,
        routers, norms), embedding (+ untied head), final norm. Biases and attention sinks are not
        counted (gpt-oss: 0.03% of its parameters)."""
        return self.linear_params + self.expert_params + self.router_params + self.norm_params + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: ``num_params`` with K of E routed experts (the banner's count)."""
        e = self.experts
        return self.num_params - (self.expert_params * (e.num_experts - e.top_k) // e.num_experts if e else 0)

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every decoder linear, the routers, the K
        routed experts a token goes to, and the LM head (a matmul even when tied). The embedding is a
        lookup and norms are negligible. For a mixture of experts these are active parameters."""
        active_experts = self.expert_params * self.experts.top_k // self.experts.num_experts if self.experts else 0
        return self.linear_params + self.router_params + active_experts + self.vocab_size * self.hidden_size

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
            vocab_size=int(cfg.get("vocab_size") or 32000),  # null in a config.json: the family's default
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_size=int(cfg.get("head_dim") or 0),
            qk_norm=cfg.get("model_type") in QK_NORM_TYPES,
            experts=experts_of(cfg),
        )


def params_line(shape: ModelShape | None) -> str | None:
    """``llmft plan``'s parameters line for a mixture of experts: the total and the active ones (a
    dense model's plan prints none: its total is every parameter a token uses)."""
    e = shape.experts if shape is not None else None
    if e is None:
        return None
    return (
        f"parameters {_count(shape.num_params)} total / {_count(shape.active_params)} active (experts {e.num_experts}, "
        f"{e.top_k} per token): memory counts the total, FLOPs and MFU the active"
    )


def _count(n: int) -> str:
    """As the banner counts (``llmft.model.structure.human_count``), without importing torch."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


_MLP = ("gate_proj", "up_proj", "down_proj")


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one Llama-style decoder layer:
    attention with grouped-query k/v, SwiGLU MLP (of ``mlp_width``; none where a mixture of experts
    has only fused experts). The one place this arithmetic lives."""
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.mlp_width,
    )
    attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)} if i else attention


def hub_cache_config(repo_id: str) -> Path | None:
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
    """Shape of ``recipe.model``, or None when it cannot be known without a download. A config whose
    sizes cannot be a model's is a ``UserError`` naming the field (``check_config``)."""
    if model_cfg.config is not None:
        fields = dict(model_cfg.config)
        check_config(fields, "model.config")
        try:
            return ModelShape.from_config(fields)
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
    path = local if local.is_file() else hub_cache_config(name)
    if path is not None:
        cfg = read_config(path)
        if cfg is None:  # not JSON: loading the model names that damage
            return None
        check_config(cfg, path)
        try:
            return ModelShape.from_config(cfg)
        except (ValueError, KeyError, TypeError):
            return None
    if name in KNOWN:
        return ModelShape.from_config(KNOWN[name])
    return None


# --- a model's config.json, checked before anything is built from it ------------------------------

# The size fields of a config, by the names families give them: (smallest value, may be null). A
# field a config does not have is not checked (the family's default applies).
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_POSITIONS = ("max_position_embeddings", "n_positions")
_SIZES: dict[str, tuple[int, bool]] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), (1, False)),
    **dict.fromkeys(_LAYERS, (1, False)),
    **dict.fromkeys(("num_attention_heads", "n_head"), (1, False)),
    **dict.fromkeys(("intermediate_size", "ffn_dim"), (1, False)),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "n_inner", "moe_intermediate_size", "vocab_size"), (1, True)),
    **dict.fromkeys(_POSITIONS, (1, True)),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok"), (0, True)),
}
# A config nests its language model's sizes here (multimodal families); checked the same way.
_NESTED = ("text_config",)


def read_config(path: Path) -> dict[str, Any] | None:
    """The fields of the config.json at ``path``; None when it is not JSON (loading the model names that
    damage, as for any file of it); a ``UserError`` naming the file when it is too large, nested too deep,
    holds a number too long to read, or is not a mapping of fields."""
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size <= limits.CONFIG_MAX_BYTES else b""
    except OSError as e:  # unreadable (permissions, an I/O error)
        raise UserError(
            Problem(str(path), f"cannot be read ({e.strerror or e})", "Check the file's permissions.")
        ) from None
    if size > limits.CONFIG_MAX_BYTES:
        raise UserError(
            Problem(
                str(path),
                f"is {size:,} bytes, above the {limits.CONFIG_MAX_BYTES:,} a model config may have",
                "A model's config.json is a few KB: check that this is the model's config (save_pretrained writes it).",
            )
        )
    try:
        cfg = json.loads(data, parse_int=_whole)
    except RecursionError:
        cfg = _TOO_DEEP
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if cfg is _TOO_DEEP or limits.nests_deeper(cfg, limits.CONFIG_MAX_DEPTH):
        field = _deep_field(data.decode("utf-8", "replace"))
        field = field if field is None or len(field) <= 60 else field[:57] + "..."
        raise UserError(
            Problem(
                str(path),
                f"{f'{field} ' if field else ''}nests objects or lists more than {limits.CONFIG_MAX_DEPTH} levels deep",
                "A model's config.json nests 3 or 4 levels: check that this is the model's config "
                "(save_pretrained writes it).",
            )
        )
    if not isinstance(cfg, dict):
        raise UserError(
            Problem(str(path), f"is a JSON {type(cfg).__name__}, not an object of config fields", _CONFIG_FIX)
        )
    return cfg


_TOO_DEEP = object()


class LongNumber(str):
    """A whole number of more digits than Python converts (4300): kept as its digits, so that the field
    holding it is named (``config_problems``) instead of the parse failing for the whole file."""

    def __repr__(self) -> str:
        return f"a number of {len(self.lstrip('-'))} digits"


def _whole(digits: str) -> int | LongNumber:
    return int(digits) if len(digits) <= 4000 else LongNumber(digits)


_CONFIG_FIX = "Write it again with save_pretrained, or copy the model's published config.json."


def _deep_field(text: str) -> str | None:
    """The top-level field under which ``text`` (JSON) nests deeper than ``CONFIG_MAX_DEPTH`` (a scan
    of its brackets and strings: nothing recursed, nothing parsed), or None (the document itself)."""
    depth, field, last, in_string, escaped, start = 0, None, None, False, False, 0
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string, last = False, text[start + 1 : i]
        elif c == '"':
            in_string, start = True, i
        elif c in "[{":
            depth += 1
            if depth > limits.CONFIG_MAX_DEPTH:
                return field
        elif c in "]}":
            depth -= 1
        elif c == ":" and depth == 1:
            field = last
    return None


def check_config_file(path: Path, *, against_weights: bool = True) -> None:
    """Refuse, naming the file and the field, a config.json that cannot be a model's (``read_config``,
    ``check_config``); one that is not JSON is left for ``AutoConfig`` to name as damaged. For every
    model directory llmft builds a model from (``llmft.model.source``), and any other reader of one.
    ``against_weights``: also compare it with the weight files beside it (``weights_problems``); not
    for a checkpoint's ``model/``, which holds an adapter's weights only beside the base's config."""
    cfg = read_config(path)
    if cfg is not None:
        check_config(cfg, path, against_weights=against_weights)


def check_config(cfg: dict[str, Any], source: str | Path, *, against_weights: bool = True) -> None:
    """Refuse, naming each field, a config whose sizes cannot be a model's (``config_problems``)."""
    problems = config_problems(cfg, source, against_weights=against_weights)
    if problems:
        raise UserError(*problems)


def config_problems(cfg: dict[str, Any], source: str | Path, *, against_weights: bool = True) -> list[Problem]:
    """What makes ``cfg`` no model llmft can build, found from its arithmetic alone: each size field a
    whole number within ``llmft.limits`` (``MODEL_SIZE_MAX``, ``MODEL_POSITIONS_MAX``), the key/value
    heads dividing the heads and the heads the hidden size (unless ``head_dim`` is given), and the
    parameters the sizes make within ``MODEL_PARAMS_MAX``. ``source``: the recipe key (``model.config``:
    problems name ``model.config.FIELD``) or the config.json (``FILE: FIELD ...``)."""
    in_file = isinstance(source, Path)

    def problem(field: str | None, what: str, fix: str) -> Problem:
        """A problem of ``field`` (None: of the config as a whole)."""
        if field is None:
            return Problem(str(source), what, fix)
        return Problem(str(source), f"{field} {what}", fix) if in_file else Problem(f"{source}.{field}", what, fix)

    problems = _level_problems(cfg, "", problem)
    for nested in _NESTED:
        if isinstance(cfg.get(nested), dict):
            problems += _level_problems(cfg[nested], f"{nested}.", problem)
        elif cfg.get(nested) is not None:
            problems.append(problem(nested, f"is {_shown(cfg[nested])}, not an object of config fields", _CONFIG_FIX))
    if in_file and against_weights and not problems:
        problems += weights_problems(cfg, Path(source))
    return problems


def weights_problems(cfg: dict[str, Any], path: Path) -> list[Problem]:
    """A config.json at ``path`` that describes far more parameters than the weight files beside it
    hold (a size with a typo, or another model's config): refused before a model is built from it,
    which would allocate what the config says. ``cfg``: its fields, or the transformers config's
    ``to_dict()`` (the family's defaults filled in). No weight files (a config-only dir, a hub
    snapshot not yet fetched): nothing to compare."""
    files = [f for pattern in ("*.safetensors", "pytorch_model*.bin") for f in path.parent.glob(pattern)]
    stored = sum(f.stat().st_size for f in files if f.is_file())
    level = cfg if any(f in cfg for f in ("hidden_size", "n_embd", "d_model")) else cfg.get("text_config")
    if not files or not isinstance(level, dict):
        return []
    sizes = {f: v for f, v in level.items() if f in _SIZES and isinstance(v, int) and not isinstance(v, bool)}
    floor = _params_floor(sizes)
    if floor <= limits.PARAMS_PER_WEIGHT_BYTE_MAX * stored:
        return []
    return [
        Problem(
            str(path),
            f"describes at least {floor:.2g} parameters, but the weight files beside it hold {stored:,} bytes "
            f"(more than {limits.PARAMS_PER_WEIGHT_BYTE_MAX} parameters a byte): a size has a typo, or the config "
            "is another model's",
            "Use the config.json saved with these weights (save_pretrained writes both), or correct the size.",
        )
    ]


def _params_floor(sizes: dict[str, int]) -> int:
    """A lower bound on the parameters of a decoder of these sizes: its embedding, and in each layer
    two matrices of the MLP and the attention's output projection (a missing size counts nothing)."""
    _, h = _first(sizes, "hidden_size", "n_embd", "d_model")
    _, layers = _first(sizes, "num_hidden_layers", "n_layer", "num_layers")
    _, inter = _first(sizes, "intermediate_size", "ffn_dim", "n_inner")
    _, heads = _first(sizes, "num_attention_heads", "n_head")
    h, heads = h or 0, heads or 0
    attention = heads * (sizes.get("head_dim") or (h // heads if heads else 0))
    return h * ((sizes.get("vocab_size") or 0) + (layers or 0) * (2 * (inter or 0) + attention))


def _level_problems(
    cfg: dict[str, Any], prefix: str, problem: Callable[[str | None, str, str], Problem]
) -> list[Problem]:
    problems, sizes = [], {}
    for field, (low, nullable) in _SIZES.items():
        if field not in cfg:
            continue
        value, high = cfg[field], _high(field)
        fix = f"Set it to a whole number in [{low}, {high:,}] (published models' values are far below the top)."
        if value is None:
            if not nullable:
                problems.append(problem(prefix + field, "is null", fix))
            continue
        if isinstance(value, LongNumber):
            problems.append(
                problem(prefix + field, f"is {value!r}, {'below' if value[0] == '-' else 'above'} {high:,}", fix)
            )
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            whole = isinstance(value, float) and value.is_integer() and low <= value <= high
            problems.append(
                problem(
                    prefix + field,
                    f"is {_shown(value)}, not a whole number",
                    f"Write it without a decimal point: {int(value)}." if whole else fix,
                )
            )
        elif not low <= value <= high:
            above = f"above the {high:,} llmft accepts for a size (a typo?)" if value > high else f"below {low}"
            problems.append(problem(prefix + field, f"is {_shown(value)}, {above}", fix))
        else:
            sizes[field] = value
    if problems:
        return problems
    return _arithmetic_problems(cfg, sizes, prefix, problem)


def _high(field: str) -> int:
    """The largest value ``field`` may have (``llmft.limits``)."""
    if field in _POSITIONS:
        return limits.MODEL_POSITIONS_MAX
    return limits.MODEL_LAYERS_MAX if field in _LAYERS else limits.MODEL_SIZE_MAX


def _first(sizes: dict[str, int], *fields: str) -> tuple[str, int | None]:
    return next(((f, sizes[f]) for f in fields if f in sizes), (fields[0], None))


def _arithmetic_problems(
    cfg: dict[str, Any], sizes: dict[str, int], prefix: str, problem: Callable[[str | None, str, str], Problem]
) -> list[Problem]:
    problems = []
    hidden_key, hidden = _first(sizes, "hidden_size", "n_embd", "d_model")
    heads_key, heads = _first(sizes, "num_attention_heads", "n_head")
    kv = sizes.get("num_key_value_heads")
    head_dim = sizes.get("head_dim")
    if heads and kv and heads % kv:
        problems.append(
            problem(
                prefix + "num_key_value_heads",
                f"is {kv}, which does not divide {heads_key} {heads}: each key/value head serves a whole "
                "number of attention heads",
                f"Use a divisor of {heads}: {_divisors(heads)}.",
            )
        )
    if hidden and heads and head_dim is None and hidden % heads:
        problems.append(
            problem(
                prefix + heads_key,
                f"is {heads}, which does not divide {hidden_key} {hidden}: each head gets {hidden_key} / "
                f"{heads_key} features",
                f"Use a divisor of {hidden} ({_divisors(hidden)}), or give head_dim.",
            )
        )
    params = _params_bound(sizes)
    if params > limits.MODEL_PARAMS_MAX:
        named = ", ".join(f"{prefix}{f} {v:,}" for f, v in sizes.items() if v > 1)
        problems.append(
            problem(
                None,
                f"the sizes {named} make up to {params:.2g} parameters ({params * 2 / 1e12:.2g} TB in bf16), above the "
                f"{limits.MODEL_PARAMS_MAX:.0e} llmft accepts: more than any machine holds",
                "One of these fields has a typo: correct it (the largest published models have about 2e12 parameters).",
            )
        )
    return problems


def _params_bound(sizes: dict[str, int]) -> int:
    """An upper bound on the parameters of a decoder of these sizes: every layer with all its experts,
    q/k/v/o, a SwiGLU MLP, an untied head and a learned position table."""
    _, h = _first(sizes, "hidden_size", "n_embd", "d_model")
    h = h or 1
    _, layers = _first(sizes, "num_hidden_layers", "n_layer", "num_layers")
    _, heads = _first(sizes, "num_attention_heads", "n_head")
    heads = heads or 1
    kv = sizes.get("num_key_value_heads") or heads
    head_dim = sizes.get("head_dim") or max(1, h // heads)
    _, inter = _first(sizes, "intermediate_size", "ffn_dim", "n_inner")
    experts = max([1] + [sizes.get(f, 0) for f in ("num_local_experts", "num_experts", "n_routed_experts")])
    mlp = 3 * h * (inter or 4 * h) + 3 * h * sizes.get("moe_intermediate_size", inter or 4 * h) * experts
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    positions = max(sizes.get(f, 0) for f in _POSITIONS) if any(f in sizes for f in _POSITIONS) else 0
    return (layers or 1) * (attention + mlp) + 2 * (sizes.get("vocab_size") or 0) * h + positions * h


def _divisors(n: int) -> str:
    small = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    return ", ".join(map(str, small[:8])) + (", ..." if len(small) > 8 else "")


def _shown(value: Any) -> str:
    """A config value as a message shows it: a huge integer by its size, anything else cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return f"{'-' if value < 0 else ''}about 10**{int(math.log10(abs(value)))}"
    try:
        text = json.dumps(value) if isinstance(value, (str, list, dict, float, bool)) or value is None else repr(value)
    except (TypeError, ValueError, RecursionError):  # not JSON (a recipe value of another type), or too deep
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


# --- a reward model directory, read without loading it -------------------------------------------

REWARD_FIX = (
    "A reward model is a sequence classifier with one label and a trained score head: train one with "
    "train.objective: reward and export it (llmft export writes an AutoModelForSequenceClassification "
    "directory), then name that directory here."
)
# Where a sequence classifier keeps its head: ``score`` (decoder families), ``classifier`` (encoders).
_HEAD_MODULES = ("score", "classifier")
_SAFETENSORS_HEADER_MAX = 100 << 20  # safetensors' own limit on a header


def reward_model_problems(path: str, key: str) -> list[Problem]:
    """What makes ``path`` no reward model (``rewards[i].model``), read from its config.json and its
    safetensors headers without loading it: no config, a config of another head (``architectures``
    ending ForCausalLM), sizes ``check_config`` refuses, more than one label, or weights that hold no
    score head (transformers would initialise one fresh, and GRPO would train on its noise). [] when
    it looks like a reward model, or is no local path (a hub id: its loading info judges it, in
    ``load_reward_model``)."""
    try:
        d = Path(path).expanduser()
        if not d.exists():
            return []  # a hub id, or nothing: from_pretrained says which when it loads
        is_dir = d.is_dir()
    except (OSError, RuntimeError) as e:  # a name too long; a ~user that does not exist
        return [Problem(key, f"'{path}' cannot be read ({type(e).__name__}: {e})", REWARD_FIX)]
    if not is_dir:
        return [Problem(key, f"'{path}' is a file, not a model directory", REWARD_FIX)]
    config = d / "config.json"
    if not config.is_file() and (d / "adapter_config.json").is_file():
        return []  # a PEFT adapter dir: transformers loads its base; its loading info judges the head
    if not config.is_file():
        return [Problem(key, f"'{path}' has no config.json, so it is not a Hugging Face model directory", REWARD_FIX)]
    try:
        cfg = read_config(config)
    except UserError as e:
        return [Problem(key, str(Problem(p.where, p.what)), p.fix) for p in e.problems]
    if cfg is None:
        return [Problem(key, f"{config} is not valid JSON", "Copy or save the reward model again (save_pretrained).")]
    problems = [Problem(key, str(Problem(p.where, p.what)), p.fix) for p in config_problems(cfg, config)]
    architectures = cfg.get("architectures")
    if isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures):
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            problems.append(
                Problem(
                    key,
                    f"{config}: architectures is {architectures}, not a sequence classifier: its weights hold no "
                    "trained score head, and GRPO would train on the scores of a freshly initialised one",
                    REWARD_FIX,
                )
            )
            return problems
    labels = cfg.get("id2label")
    if isinstance(labels, dict) and len(labels) != 1:
        problems.append(
            Problem(key, f"{config}: id2label has {len(labels)} labels; a reward model scores with one", REWARD_FIX)
        )
        return problems
    return problems + _head_problems(d, key)


def _head_problems(d: Path, key: str) -> list[Problem]:
    """The safetensors files of ``d`` hold a score head of one row (none checked when ``d`` has no
    safetensors files: the loading info of ``load_reward_model`` judges those)."""
    try:
        shapes = _safetensors_shapes(d)
    except ValueError as e:
        return [Problem(key, str(e), "Copy or save the reward model again (save_pretrained).")]
    if shapes is None:
        return []
    head = {k: v for k, v in shapes.items() if any(m in k.split(".")[:-1] for m in _HEAD_MODULES)}
    if not head:
        return [
            Problem(
                key,
                f"the weights of '{d}' hold no score head (no score.weight): transformers would initialise it fresh, "
                "and GRPO would train on the scores of that random head",
                REWARD_FIX,
            )
        ]
    rows = [(k, s) for k, s in head.items() if k.endswith("score.weight") and s and s[0] != 1]
    if rows:
        return [
            Problem(
                key,
                f"{rows[0][0]} in '{d}' has shape {rows[0][1]}: a classifier of {rows[0][1][0]} labels; a reward "
                "model scores with one",
                REWARD_FIX,
            )
        ]
    return []


def _safetensors_shapes(d: Path) -> dict[str, list[int] | None] | None:
    """Each tensor of ``d``'s safetensors weights and its shape (None where only the index names it),
    read from the index or the single file's header; None when ``d`` has neither. ValueError: damaged."""
    weight_map = _weight_map(d)
    if weight_map is not None:
        shapes: dict[str, list[int] | None] = dict.fromkeys(weight_map)
        for name in {v for k, v in weight_map.items() if isinstance(v, str) and k.endswith("score.weight")}:
            file = d / Path(name).name
            if file.is_file():
                shapes.update({k: v for k, v in _header_shapes(file).items() if k in shapes})
        return shapes
    single = d / "model.safetensors"
    return _header_shapes(single) if single.is_file() else None


def _header_shapes(path: Path) -> dict[str, list[int] | None]:
    """The tensors a safetensors file's header lists (8 bytes of length, then that much JSON)."""
    with open(path, "rb") as f:
        length = _header_length(path, f)
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: is damaged (its header is not JSON: {type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: is damaged (its header is not a JSON object)")
    return {
        k: (v.get("shape") if isinstance(v, dict) and isinstance(v.get("shape"), list) else None)
        for k, v in header.items()
        if k != "__metadata__"
    }


def safetensors_bytes(d: Path) -> int | None:
    """The bytes of the tensors in ``d``'s safetensors weights (each file's size less its header: what
    loading them in their stored dtype allocates); None when ``d`` has none. ValueError: damaged."""
    weight_map = _weight_map(d)
    if weight_map is not None:
        files = [d / Path(name).name for name in {v for v in weight_map.values() if isinstance(v, str)}]
    else:
        files = [d / "model.safetensors"]
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            total += path.stat().st_size - 8 - _header_length(path, f)
    return total


def _weight_map(d: Path) -> dict[str, Any] | None:
    """The tensor -> file map of ``d``'s ``model.safetensors.index.json``; None when ``d`` has no
    index (a single file, or none). ValueError: the index is damaged."""
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        data = read_config(index)
    except UserError as e:
        raise ValueError(str(e)) from None
    weight_map = data.get("weight_map") if data is not None else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: has no weight_map")
    return weight_map


def _header_length(path: Path, f: Any) -> int:
    """The header length a safetensors file ``f`` (opened at its start) begins with, checked to fit
    the file. ValueError: it does not."""
    size = path.stat().st_size
    length = int.from_bytes(f.read(8), "little")
    if size < 8 or not 2 <= length <= min(_SAFETENSORS_HEADER_MAX, size - 8):
        raise ValueError(f"{path}: is damaged (its header length {length} does not fit the file's {size} bytes)")
    return length


def reward_model_shape(path: str) -> ModelShape | None:
    """The shape of the reward model ``path`` names, from its config.json (a local directory, or the
    Hugging Face cache); None when neither has one, or it is not a shape llmft reads."""
    d = Path(path).expanduser()
    try:
        local = d / "config.json"
        config = local if local.is_file() else hub_cache_config(path)
        cfg = read_config(config) if config is not None else None
        return ModelShape.from_config(cfg) if cfg is not None else None
    except (OSError, UserError, ValueError, KeyError, TypeError):
        return None
