"""The DPO family's plan-side pieces (``train.objective: dpo``; ``preference.*``): its recipe
checks and its model-card words, named by its record in ``plan/objectives.py`` (``problems``,
``card_words``) and called through it. Pure: no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from llmft.errors import Problem
from llmft.plan.objectives import NO_REFERENCE, REFERENCE, objective_of, reference_kind

if TYPE_CHECKING:
    from llmft.plan.objectives import ObjectiveSpec
    from llmft.recipe.schema import Recipe


def preference_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What the DPO family cannot do with this recipe's ``preference.*``."""
    p = recipe.preference
    problems: list[Problem] = []
    if p.label_smoothing and p.loss_type != "sigmoid":
        problems.append(
            Problem(
                where("preference.label_smoothing"),
                f"is {p.label_smoothing}, but only loss_type=sigmoid (conservative DPO) uses it; "
                f"loss_type is {p.loss_type}",
                "Set preference.label_smoothing=0, or preference.loss_type=sigmoid.",
            )
        )
    if not 0.0 <= p.label_smoothing < 0.5:
        problems.append(
            Problem(where("preference.label_smoothing"), f"is {p.label_smoothing}", "Use a value in [0, 0.5).")
        )
    if p.precompute_reference:
        problems += _precompute_problems(recipe, where)
    return problems


def _precompute_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """``preference.precompute_reference``: stored with the token cache entry, so cached pairs and
    a loss that has a reference (docs/preference.md "Precomputed reference")."""
    if reference_kind(recipe) == NO_REFERENCE:
        what = (
            f"loss_type={recipe.preference.loss_type} is reference-free"
            if REFERENCE in objective_of(recipe).frozen
            else f"train.objective={recipe.train.objective} has no reference model"
        )
        return [
            Problem(
                where("preference.precompute_reference"),
                f"is true, but {what}: there are no reference log-probs to precompute",
                "Set preference.precompute_reference=false.",
            )
        ]
    if recipe.data.streaming:
        return [
            Problem(
                where("preference.precompute_reference"),
                "is true, but data.streaming is true: the reference log-probs are stored with the token cache "
                "entry, and a stream has none (its pairs are tokenized as training reaches them)",
                "Set data.streaming=false (the pairs go through the token cache; `llmft prepare` builds it "
                "ahead), or preference.precompute_reference=false (the reference runs on the fly).",
            )
        ]
    return []


def card_words(spec: ObjectiveSpec, recipe: dict) -> str:
    """The model card's words: the record's ``card``, then the ``preference.*`` settings it ran with."""
    p = recipe.get("preference") or {}
    words = f"{spec.card}, loss_type {p.get('loss_type')}, beta {p.get('beta')}"
    if p.get("label_smoothing"):
        words += f", label_smoothing {p['label_smoothing']}"
    if p.get("loss_type") == "simpo":
        words += f", simpo_gamma {p.get('simpo_gamma')}"
    return words
