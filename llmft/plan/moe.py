"""The mixture-of-experts families: one record per family, found by one lookup (``moe_family``).

A record says where a family's model config keeps what the router's losses need (the number of
routed experts, the experts per token, the balancing loss's weight, a z-loss's weight where the
family has one) and which attribute of its causal-LM module weights the balancing loss that
transformers adds to ``.loss`` itself. Every family here computes its balancing loss with
transformers' ``load_balancing_loss_func`` over ``output.router_logits`` (the Switch Transformer
loss, one definition shared by all of them in transformers 5); llmft computes the same loss over the
global batch (``llmft.model.moe``).

A family outside this list describes itself with ``register_moe_family(MoEFamily(...))`` in the module
that ``train.objective_module`` names (imported when the recipe is loaded). Pure: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from llmft.errors import Problem, UserError
from llmft.plan.engines import choose_engine, engine_spec

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe

# Config keys that mark a mixture of experts: a config with one of them > 1 and no record is refused.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture of experts (``experts_of`` reads them from a config)."""

    num_experts: int  # routed experts per MoE layer (E)
    top_k: int  # experts each token is routed to (K)
    ffn: int  # one routed expert's FFN width: a SwiGLU expert holds 3 x hidden x ffn weights
    shared_ffn: int = 0  # the always-on shared experts' FFN width per MoE layer (nn.Linear layers); 0: none
    shared_gate: bool = False  # a hidden -> 1 linear gate scales the shared expert (qwen2_moe, qwen3_next)
    num_layers: int = 0  # decoder layers whose MLP is routed; the others have a dense MLP


@dataclass(frozen=True)
class MoEFamily:
    """One MoE family as transformers ships it (``model_type``)."""

    model_type: str
    experts: str  # config attribute: routed experts per MoE layer (E)
    top_k: str = "num_experts_per_tok"  # config attribute: experts each token is routed to (K)
    # Config attribute of the balancing loss's weight; None: transformers defines no balancing loss
    # for the family (its router is balanced another way), so llmft adds none.
    aux_coef: str | None = "router_aux_loss_coef"
    # The causal-LM module's attribute its forward multiplies ``aux_loss`` by before adding it to ``.loss``.
    coef_attr: str = "router_aux_loss_coef"
    z_loss: str | None = None  # config attribute of the router z-loss's weight; None: the family has none
    # What the planner counts (``experts_of``): the config attribute of one routed expert's FFN width
    # (a SwiGLU expert holds 3 x hidden x width weights), the shared experts' (an always-on MLP of
    # that width, or that many experts as wide as a routed one), whether a hidden -> 1 gate scales the
    # shared expert, and the rule for which layers are MoE: None (all), "decoder_sparse_step" (not in
    # ``mlp_only_layers`` and every ``decoder_sparse_step``-th), "first_k_dense_replace" (all but the first k).
    expert_ffn: str = "intermediate_size"
    shared_ffn: str | None = None
    shared_experts: str | None = None
    shared_gate: bool = False
    sparse_layers: str | None = None
    # LoRA on the experts: name suffixes of the fused ``[experts, ., .]`` weights it adapts
    # (``peft.target_experts``, PEFT's ``target_parameters``), and of the router module that
    # ``peft.train_router`` trains in full (PEFT's ``modules_to_save``).
    expert_weights: tuple[str, ...] = ("experts.gate_up_proj", "experts.down_proj")
    router: str = "mlp.gate"


_QWEN_SPARSE = "decoder_sparse_step"
_QWEN_SHARED = dict(
    expert_ffn="moe_intermediate_size",
    shared_ffn="shared_expert_intermediate_size",
    shared_gate=True,
    sparse_layers=_QWEN_SPARSE,
)


def _families(*records: MoEFamily) -> dict[str, MoEFamily]:
    return {r.model_type: r for r in records}


_FAMILIES: dict[str, MoEFamily] = _families(
    MoEFamily("qwen3_moe", experts="num_experts", expert_ffn="moe_intermediate_size", sparse_layers=_QWEN_SPARSE),
    MoEFamily("qwen2_moe", experts="num_experts", **_QWEN_SHARED),
    MoEFamily("qwen3_next", experts="num_experts", **_QWEN_SHARED),
    MoEFamily("olmoe", experts="num_experts"),
    MoEFamily("flex_olmo", experts="num_experts"),
    MoEFamily("mixtral", experts="num_local_experts"),
    MoEFamily("gpt_oss", experts="num_local_experts", router="mlp.router"),
    MoEFamily("granitemoe", experts="num_local_experts", router="block_sparse_moe.router"),
    MoEFamily(
        "granitemoeshared",
        experts="num_local_experts",
        shared_ffn="shared_intermediate_size",
        router="block_sparse_moe.router",
    ),
    MoEFamily("phimoe", experts="num_local_experts", router="mlp.router"),
    MoEFamily("minimax", experts="num_local_experts"),
    MoEFamily("minimax_m2", experts="num_local_experts"),
    MoEFamily(
        "jetmoe",
        experts="num_local_experts",
        aux_coef="aux_loss_coef",
        coef_attr="aux_loss_coef",
        expert_weights=("mlp.input_linear.weight", "mlp.output_linear.weight"),
        router="mlp.router",
    ),
    # Auxiliary-loss-free routing (a per-expert score bias): no balancing loss in transformers.
    MoEFamily(
        "deepseek_v3",
        experts="n_routed_experts",
        aux_coef=None,
        expert_ffn="moe_intermediate_size",
        shared_experts="n_shared_experts",
        sparse_layers="first_k_dense_replace",
    ),
)


def config_experts(family: MoEFamily, get: Any) -> Any:
    """The routed experts a config holds (``get``: its ``dict.get``): under the family's key, or the
    other name transformers 5 gives it (its configs map ``num_experts`` to ``num_local_experts`` and
    save that, so a config.json it wrote may hold either)."""
    for key in (family.experts, *EXPERT_ALIASES.get(family.experts, ())):
        if get(key) is not None:
            return get(key)
    return None


EXPERT_ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",)}


def register_moe_family(family: MoEFamily) -> MoEFamily:
    """Add (or replace) the record of ``family.model_type``."""
    _FAMILIES[family.model_type] = family
    return family


def moe_family(config: Mapping[str, Any] | Any) -> MoEFamily | None:
    """The record of a model config (a mapping, or a transformers config object); None for a dense
    model. A config that looks like a mixture of experts but has no record is refused."""
    get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    model_type = get("model_type")
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    marks = [key for key in EXPERT_KEYS if isinstance(get(key), int) and get(key) > 1]
    if not marks:
        return None
    raise UserError(
        Problem(
            "model",
            f"model_type {model_type!r} looks like a mixture of experts ({marks[0]}: {get(marks[0])}) but llmft "
            "has no description of its routing (where its config keeps the number of experts, the experts per "
            "token and the balancing loss's weight, and whether its router returns router_logits), so its "
            "balancing loss would be left out silently",
            "Describe the family in the module train.objective_module names: llmft.plan.moe.register_moe_family("
            f"MoEFamily({model_type!r}, experts={marks[0]!r}, top_k='num_experts_per_tok', "
            "aux_coef='router_aux_loss_coef')), or use a family docs/moe.md lists.",
        )
    )


def experts_of(config: Mapping[str, Any]) -> Experts | None:
    """The routed experts a model config describes (``Experts``), read with its family's record;
    None for a dense model, or a config without its number of experts. Pure arithmetic, for the
    planner's total and active parameter counts (``llmft.plan.shape.ModelShape``)."""
    family = moe_family(config)
    num_experts = config_experts(family, config.get) if family is not None else None
    if not isinstance(num_experts, int) or num_experts < 1:
        return None
    ffn = int(config.get(family.expert_ffn) or config.get("intermediate_size") or 0)
    shared = int(config.get(family.shared_ffn) or 0) if family.shared_ffn else 0
    if family.shared_experts:
        shared += int(config.get(family.shared_experts) or 0) * ffn
    layers = int(config.get("num_hidden_layers") or 1)
    if family.sparse_layers == "first_k_dense_replace":
        moe_layers = max(layers - int(config.get("first_k_dense_replace") or 0), 0)
    elif family.sparse_layers == "decoder_sparse_step":
        step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:
        moe_layers = layers
    return Experts(
        num_experts=num_experts,
        top_k=int(config.get(family.top_k) or 1),
        ffn=ffn,
        shared_ffn=shared,
        shared_gate=family.shared_gate and shared > 0,
        num_layers=moe_layers,
    )


def family_problems(family: MoEFamily, moe: Any) -> list[Problem]:
    """What the recipe's ``moe`` section asks that ``family`` cannot give."""
    problems = []
    for key, defined, what in (
        (
            "aux_loss_coef",
            family.aux_coef,
            "router balancing loss in transformers (its routing is balanced without one)",
        ),
        (
            "z_loss_coef",
            family.z_loss,
            "router z-loss in transformers (only the load-balancing loss, moe.aux_loss_coef)",
        ),
    ):
        value = getattr(moe, key)
        if value is not None and value < 0:
            problems.append(Problem(f"moe.{key}", f"{value} is negative", "Set it >= 0 (0: off)."))
        elif defined is None and value:
            problems.append(
                Problem(
                    f"moe.{key}",
                    f"{family.model_type} defines no {what}, so there is none to weigh",
                    f"Remove moe.{key} from the recipe (or set it to 0).",
                )
            )
    return problems


def experts_adapted(family: MoEFamily | None, peft: Any) -> bool:
    """Whether LoRA goes on the fused expert weights: ``peft.target_experts``; null: on for an MoE
    model under lora (PEFT has no DoRA on parameters)."""
    if family is None or peft.method == "none":
        return False
    return peft.target_experts if peft.target_experts is not None else peft.method == "lora"


def lora_problems(family: MoEFamily | None, peft: Any, model_type: Any) -> list[Problem]:
    """What ``peft.target_experts`` and ``peft.train_router`` ask that the model (``family``; None:
    a dense model) or the adapter cannot give."""
    asked = [key for key in ("target_experts", "train_router") if getattr(peft, key)]
    if family is None:
        return [
            Problem(
                f"peft.{key}",
                f"is true, but the model ({model_type!r}) is dense: it has no experts and no router",
                f"Remove peft.{key} from the recipe (it applies to mixture-of-experts models only, docs/moe.md).",
            )
            for key in asked
        ]
    if peft.method == "none":
        return [
            Problem(
                f"peft.{key}",
                "is true, but peft.method is none: a full fine-tune trains the experts and the router already",
                f"Set peft.method: lora, or remove peft.{key} from the recipe.",
            )
            for key in asked
        ]
    if peft.method == "dora" and peft.target_experts:
        return [
            Problem(
                "peft.target_experts",
                "is true, but peft.method is dora: PEFT's LoRA on the fused expert weights has no DoRA variant",
                "Set peft.method: lora, or peft.target_experts: false (DoRA on the other layers only).",
            )
        ]
    if experts_adapted(family, peft) and peft.dropout:
        return [
            Problem(
                "peft.dropout",
                f"is {peft.dropout}, but LoRA on the fused expert weights of {model_type} (peft.target_experts, on "
                "by default for a mixture of experts) adds its update to the weight, so there is no input to drop",
                "Set peft.dropout: 0, or peft.target_experts: false to leave the experts out of LoRA.",
            )
        ]
    return []


def expert_parallel_model_problems(family: MoEFamily | None, config: Any, peft: Any, n: int) -> list[Problem]:
    """What ``distributed.expert_parallel: n`` asks of the model (``config``: a mapping or a
    transformers config; ``family``: its record, None for a dense model) and of its adapter."""
    get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    key = "distributed.expert_parallel"
    if family is None:
        return [
            Problem(
                key,
                f"is {n}, but the model ({get('model_type')!r}) is dense: it has no experts to place on ranks",
                "Set distributed.expert_parallel=1 (it applies to mixture-of-experts models only, docs/moe.md).",
            )
        ]
    experts = config_experts(family, get)
    problems = []
    if isinstance(experts, int) and experts % n:
        options = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        problems.append(
            Problem(
                key,
                f"is {n}, which does not divide the {experts} routed experts of each MoE layer ({family.experts}): "
                "every rank holds the same number of whole experts",
                f"Choose a divisor of {experts} that also divides the shard dimension: one of {options}.",
            )
        )
    if experts_adapted(family, peft):
        problems.append(
            Problem(
                key,
                f"is {n} with LoRA on the experts (peft.target_experts): LoRA on experts placed on other ranks "
                "is not built",
                "Set peft.target_experts=false (LoRA on the other layers; the experts stay frozen and are placed "
                "on ranks), or distributed.expert_parallel=1.",
            )
        )
    return problems


def packs_experts(recipe: Recipe, engine: str | None = None) -> bool:
    """Whether the run's engine (``engine``, resolved; None: the recipe's, ``auto`` chosen for its
    launch size) packs the fused experts of a 4-bit base in 4 bits (``EngineSpec.packs_experts``: every
    built-in engine does). On an engine that does not they stay in ``model.dtype``, sharded like any
    other weight."""
    q = recipe.model.quantization
    if q is None or q.bits != 4:
        return False
    d = recipe.distributed
    return engine_spec(engine or choose_engine(recipe, d.nnodes * d.nproc_per_node)).packs_experts
