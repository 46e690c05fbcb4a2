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

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from llmft.errors import Problem, UserError
from llmft.plan.shape import hub_cache_config, read_config

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe

# Config keys that mark a mixture of experts: a config with one of them > 1 and no record is refused.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


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


def _families(*records: MoEFamily) -> dict[str, MoEFamily]:
    return {r.model_type: r for r in records}


_FAMILIES: dict[str, MoEFamily] = _families(
    MoEFamily("qwen3_moe", experts="num_experts"),
    MoEFamily("qwen2_moe", experts="num_experts"),
    MoEFamily("qwen3_next", experts="num_experts"),
    MoEFamily("olmoe", experts="num_experts"),
    MoEFamily("flex_olmo", experts="num_experts"),
    MoEFamily("mixtral", experts="num_local_experts"),
    MoEFamily("gpt_oss", experts="num_local_experts"),
    MoEFamily("granitemoe", experts="num_local_experts"),
    MoEFamily("granitemoeshared", experts="num_local_experts"),
    MoEFamily("phimoe", experts="num_local_experts"),
    MoEFamily("minimax", experts="num_local_experts"),
    MoEFamily("minimax_m2", experts="num_local_experts"),
    MoEFamily("jetmoe", experts="num_local_experts", aux_coef="aux_loss_coef", coef_attr="aux_loss_coef"),
    # Auxiliary-loss-free routing (a per-expert score bias): no balancing loss in transformers.
    MoEFamily("deepseek_v3", experts="n_routed_experts", aux_coef=None),
)


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


def family_problems(family: MoEFamily, moe: Any) -> list[Problem]:
    """What the recipe's ``moe`` section asks that ``family`` cannot give."""
    problems = []
    if moe.aux_loss_coef is not None and moe.aux_loss_coef < 0:
        problems.append(Problem("moe.aux_loss_coef", f"{moe.aux_loss_coef} is negative", "Set it >= 0 (0: off)."))
    if family.aux_coef is None and moe.aux_loss_coef:
        problems.append(
            Problem(
                "moe.aux_loss_coef",
                f"{family.model_type} defines no router balancing loss in transformers (its routing is balanced "
                "without one), so there is none to weigh",
                "Remove moe.aux_loss_coef from the recipe (or set it to 0).",
            )
        )
    if moe.z_loss_coef is not None and moe.z_loss_coef < 0:
        problems.append(Problem("moe.z_loss_coef", f"{moe.z_loss_coef} is negative", "Set it >= 0 (0: off)."))
    if family.z_loss is None and moe.z_loss_coef:
        problems.append(
            Problem(
                "moe.z_loss_coef",
                f"{family.model_type} defines no router z-loss in transformers (only the load-balancing loss, "
                "moe.aux_loss_coef), so there is none to weigh",
                "Remove moe.z_loss_coef from the recipe (or set it to 0).",
            )
        )
    return problems


def moe_problems(recipe: Recipe, where: Callable[[str], str] = str) -> list[Problem]:
    """The ``moe`` section against the model, when its config can be read without a download
    (``model.config``, a local directory, the hub cache); else the build checks it
    (``llmft.model.moe.install``)."""
    config = _readable_config(recipe.model)
    if config is None:
        return []
    try:
        family = moe_family(config)
    except UserError as e:
        key = "model.config" if recipe.model.config is not None else "model.name_or_path"
        return [Problem(where(key), p.what, p.fix) for p in e.problems]
    moe = recipe.moe
    if family is not None:
        problems = [Problem(where(p.where), p.what, p.fix) for p in family_problems(family, moe)]
        sp = recipe.distributed.sequence_parallel
        if sp > 1 and moe.aux_loss_coef != 0 and family.aux_coef is not None:
            problems.append(
                Problem(
                    where("distributed.sequence_parallel"),
                    f"is {sp}, but the balancing loss of a mixture of experts ({family.model_type}) is not built "
                    "for sequence slices yet: each rank's router sees a slice of every sequence",
                    "Set distributed.sequence_parallel=1, or moe.aux_loss_coef=0 to train without the balancing loss.",
                )
            )
        return problems
    asked = [f.name for f in fields(moe) if getattr(moe, f.name) != f.default]
    model_type = config.get("model_type")
    return [
        Problem(
            where(f"moe.{name}"),
            f"is set, but the model ({model_type!r}) is dense: it has no experts and no router, so there is "
            "no routing for moe.* to act on",
            f"Remove moe.{name} from the recipe (moe.* applies to mixture-of-experts models only, docs/moe.md).",
        )
        for name in asked
    ]


def _readable_config(model: Any) -> dict[str, Any] | None:
    if model.config is not None:
        return dict(model.config)
    if model.name_or_path is None:
        return None
    local = Path(model.name_or_path) / "config.json"
    path = local if local.is_file() else hub_cache_config(model.name_or_path)
    return read_config(path) if path is not None else None
