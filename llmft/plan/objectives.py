"""The objective registry: one record per ``train.objective``, found by one lookup (``objective_spec``).

A record says what an objective is: what it normalises the loss by (``tokens``: the target tokens
of the global batch, ``pairs``: its preference pairs), which model head it trains, whether it
reads preference pairs, and which code computes its loss (``runtime``, a dotted path imported
only when a run builds it: this module, like the rest of ``llmft.plan``, imports no torch).

The loop never branches on the objective's name: it asks the runtime object for the count of a
micro-batch and for the micro loss numerator divided by the global count (docs/design.md,
docs/preference.md). Adding an objective is a record here and a class under ``llmft/objectives/``.

How a preference run gets its reference model is decided here too (``reference_kind``), once, from
the recipe: the plan carries the decision and the engines build what it says.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Literal

from llmft.errors import Problem
from llmft.recipe.schema import PreferenceConfig

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: what it counts, what it trains, and where its code lives."""

    name: str  # train.objective
    title: str  # in messages
    runtime: str | None  # the Objective class (torch side); None: not built yet (refused at resolve)
    counts: Literal["tokens", "pairs"]  # what the micro loss is normalised by (global batch)
    head: Literal["lm", "score"] = "lm"  # the causal-LM head, or a scalar score head
    pairs: bool = False  # consumes preference pairs (batch.global_batch_size counts pairs)
    preference_keys: bool = False  # reads preference.* (loss_type, beta, reference, ...)

    @property
    def rows_per_item(self) -> int:
        """Sequences one item of the data holds (a micro-batch of P items runs P x this rows)."""
        return 2 if self.pairs else 1  # a pair: chosen and rejected


OBJECTIVES: tuple[ObjectiveSpec, ...] = (
    ObjectiveSpec(name="sft", title="SFT", runtime="llmft.objectives.sft:SFTObjective", counts="tokens"),
    ObjectiveSpec(
        name="dpo",
        title="DPO",
        runtime="llmft.objectives.preference:PreferenceObjective",
        counts="pairs",
        pairs=True,
        preference_keys=True,
    ),
    ObjectiveSpec(
        name="reward",
        title="reward model",
        runtime="llmft.objectives.reward:RewardObjective",
        counts="pairs",
        head="score",
        pairs=True,
    ),
)

_BY_NAME = {spec.name: spec for spec in OBJECTIVES}
OBJECTIVE_NAMES: tuple[str, ...] = tuple(_BY_NAME)

# Losses that compare the policy with itself only: no reference model is built or run.
REFERENCE_FREE_LOSSES = ("simpo", "orpo")

# How a preference run gets its reference log-probs (RunPlan.reference).
NO_REFERENCE = "none"
ADAPTERS_DISABLED = "adapters_disabled"  # LoRA/QLoRA: the policy itself inside PEFT's disable_adapter()
FROZEN_COPY = "frozen_copy"  # full fine-tune: a frozen copy of the initial weights, built like the policy
REFERENCE_MODEL = "model"  # preference.reference names a model: built like the policy's base


def objective_spec(name: str) -> ObjectiveSpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise AssertionError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVE_NAMES)}") from None


def reference_kind(recipe: Recipe) -> str:
    """What the run uses as its reference model (one of the constants above)."""
    p = recipe.preference
    if not objective_spec(recipe.train.objective).pairs or recipe.train.objective != "dpo":
        return NO_REFERENCE
    if p.loss_type in REFERENCE_FREE_LOSSES:
        return NO_REFERENCE
    if p.reference != "auto":
        return REFERENCE_MODEL
    return ADAPTERS_DISABLED if recipe.peft.method != "none" else FROZEN_COPY


def objective_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What this objective cannot do (yet) with this recipe; empty for SFT."""
    spec = objective_spec(recipe.train.objective)
    p = recipe.preference
    problems: list[Problem] = []
    if spec.runtime is None:
        problems.append(
            Problem(
                where("train.objective"),
                f"{spec.name} ({spec.title}) is not implemented yet",
                "Use train.objective=sft or dpo (docs/preference.md says what is done).",
            )
        )
    problems += head_problems(spec, recipe, where)
    if not spec.pairs or not spec.preference_keys:  # head_problems named any preference.* key set
        return problems
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
            if recipe.train.objective == "dpo"
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


def head_problems(spec: ObjectiveSpec, recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What an objective that trains another head than the causal LM's (a reward model's score)
    cannot do, and ``preference.*`` keys set for an objective that does not read them."""
    problems: list[Problem] = []
    if spec.head != "lm" and recipe.model.liger_kernels:  # Liger patches a causal LM's head and loss
        problems.append(
            Problem(
                where("model.liger_kernels"),
                f"is true, but train.objective={spec.name} trains a {spec.head} head, not the causal-LM head "
                "Liger's fused loss replaces",
                "Set model.liger_kernels=false.",
            )
        )
    if spec.head != "lm" and recipe.train.eval_generate_samples:  # a score head generates no text
        problems.append(
            Problem(
                where("train.eval_generate_samples"),
                f"is {recipe.train.eval_generate_samples}, but train.objective={spec.name} trains a {spec.head} "
                "head, which generates no text",
                "Set train.eval_generate_samples=0 (the eval reports the pair loss and rewards/accuracy).",
            )
        )
    if spec.pairs and not spec.preference_keys:  # a key the user set would be silently ignored
        default = PreferenceConfig()
        for f in fields(PreferenceConfig):
            value = getattr(recipe.preference, f.name)
            if value != getattr(default, f.name):
                problems.append(
                    Problem(
                        where(f"preference.{f.name}"),
                        f"is {value}, but train.objective={spec.name} does not read preference.* (the DPO "
                        "family's settings)",
                        f"Remove it (default {getattr(default, f.name)}), or set train.objective=dpo.",
                    )
                )
    return problems
