"""Online RL's plan-side pieces (``rollout.*``, ``rl.*``, ``rewards``): pure, no torch.

GRPO's record (``plan/objectives.py``) names them and the generic code calls them through it:
``rl_problems``, its recipe checks (``ObjectiveSpec.problems``); ``rl_lines``, what ``llmft
compile``, ``llmft plan`` and the banner print under the batch line (``summary``); ``card_words``,
its model-card words. A step holding whole groups of G completions is the record's ``group``,
checked once the batch is solved (``objectives.group_problems``); a recipe that sets these keys
for an objective that does not read them is refused there too (``objectives.unread_problems``).
``parse_rewards`` and ``import_function`` read ``rewards`` for the runtime (``objectives/rewards.py``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from llmft.errors import Problem, UserError
from llmft.plan.deepspeed import DTYPE_BYTES
from llmft.plan.objectives import objective_of
from llmft.plan.shape import ModelShape, model_shape, reward_model_problems

if TYPE_CHECKING:
    from llmft.plan.layout import RunPlan
    from llmft.plan.objectives import ObjectiveSpec
    from llmft.recipe.schema import Recipe


def parse_rewards(entries: list[Any]) -> list[tuple[str, str, float]]:
    """(kind ``function`` | ``model``, what, weight) per entry of ``rewards``; a UserError naming
    ``rewards[i]`` for each bad one."""
    out, problems = [], []
    for i, entry in enumerate(entries):
        where = f"rewards[{i}]"
        if not hasattr(entry, "items"):
            problems.append(
                Problem(where, f"is {entry!r}", 'Write {function: "module:name", weight: 1.0} or {model: DIR}.')
            )
            continue
        entry = dict(entry.items())
        kinds = [k for k in ("function", "model") if entry.get(k)]
        unknown = sorted(set(entry) - {"function", "model", "weight"})
        if unknown:
            problems.append(
                Problem(f"{where}.{unknown[0]}", "is not a key of a reward", "Use function, model and weight.")
            )
        if len(kinds) != 1:
            problems.append(
                Problem(
                    where, "needs exactly one of function and model", 'e.g. {function: "my_rewards:exact", weight: 1.0}'
                )
            )
            continue
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append(Problem(f"{where}.weight", f"is {weight!r}", "Use a finite number."))
            continue
        what = str(entry[kinds[0]])
        if kinds[0] == "function" and (":" not in what or not all(what.partition(":")[::2])):
            problems.append(
                Problem(
                    f"{where}.function",
                    f"is {what!r}, not module:name",
                    'Name a module and a function: "my_rewards:exact".',
                )
            )
            continue
        out.append((kinds[0], what, float(weight)))
    if problems:
        raise UserError(*problems)
    return out


def import_function(what: str, key: str) -> Callable[..., Any]:
    """The function ``module:name`` names (importing runs the user's module: code the recipe names,
    like ``train.objective_module``); a UserError naming ``key`` when it cannot be had."""
    module_name, _, name = what.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UserError(
            Problem(
                key,
                f"cannot import module {module_name!r} ({type(e).__name__}: {e})",
                "Name a module importable on every rank (installed, or on PYTHONPATH).",
            )
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module_name
        )
        raise UserError(
            Problem(
                key,
                f"module {module_name!r} has no function {name!r}",
                f"Use one of its functions ({', '.join(defined[:12]) or 'it defines none'}).",
            )
        )
    return fn


def rl_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What an online-RL recipe cannot do."""
    spec, r, rl = objective_of(recipe), recipe.rollout, recipe.rl
    problems: list[Problem] = []

    def bad(key: str, what: str, fix: str) -> None:
        problems.append(Problem(where(key), what, fix))

    if r.num_generations < 2:
        bad(
            "rollout.num_generations",
            f"is {r.num_generations}",
            "Use 2 or more: advantages compare a prompt's completions with each other.",
        )
    if r.max_new_tokens < 1:
        bad("rollout.max_new_tokens", f"is {r.max_new_tokens}", "Use 1 or more.")
    if not r.temperature > 0:
        bad(
            "rollout.temperature",
            f"is {r.temperature}",
            "Use a temperature above 0 (sampling; 1.0 samples the model as it is).",
        )
    if not 0 < r.top_p <= 1:
        bad("rollout.top_p", f"is {r.top_p}", "Use a value in (0, 1].")
    if r.batch_size is not None and r.batch_size < 1:
        bad("rollout.batch_size", f"is {r.batch_size}", "Use 1 or more, or null.")
    if r.backend == "file" and not r.file:
        bad(
            "rollout.file",
            "is not set, but rollout.backend is file",
            "Name the JSONL of prompts and their completions.",
        )
    if rl.beta < 0:
        bad("rl.beta", f"is {rl.beta}", "Use 0 (no reference model) or more.")
    if not 0 <= rl.epsilon < 1:
        bad("rl.epsilon", f"is {rl.epsilon}", "Use a value in [0, 1).")
    if rl.epsilon_high is not None and rl.epsilon_high < 0:
        bad("rl.epsilon_high", f"is {rl.epsilon_high}", "Use 0 or more, or null (rl.epsilon).")
    if rl.iterations < 1:
        bad("rl.iterations", f"is {rl.iterations}", "Use 1 or more.")
    if not rl.is_cap > 0:
        bad("rl.is_cap", f"is {rl.is_cap}", "Use a cap above 0 (TRL's default is 3.0).")
    if importance_correction(recipe) == "tis" and r.backend == "file":
        bad(
            "rl.importance_correction",
            "is tis, but rollout.backend is file: a file's completions come without the sampler's log-probs",
            "Set rl.importance_correction=none, or generate with rollout.backend=hf.",
        )
    if not recipe.rewards:
        bad(
            "rewards",
            "is empty: nothing scores the completions",
            'Add {function: "module:name", weight: 1.0} or {model: DIR}.',
        )
    try:
        entries = parse_rewards(list(recipe.rewards))
    except UserError as e:
        entries = []
        problems += [Problem(where(p.where), p.what, p.fix) for p in e.problems]
    for i, (kind, what, _) in enumerate(entries):  # every function that cannot be had, not the first only
        if kind != "function":  # a reward model dir without a trained score head: before the policy loads
            found = reward_model_problems(what, f"rewards[{i}].model")
            problems += [Problem(where(p.where), p.what, p.fix) for p in found]
            continue
        try:
            import_function(what, f"rewards[{i}].function")
        except UserError as e:
            problems += [Problem(where(p.where), p.what, p.fix) for p in e.problems]
    if recipe.distributed.sequence_parallel > 1:
        bad(
            "distributed.sequence_parallel",
            f"is {recipe.distributed.sequence_parallel}, but train.objective={spec.name} does not run with sequence parallelism yet",
            "Set distributed.sequence_parallel=1.",
        )
    return problems


def rl_lines(plan: RunPlan) -> list[str]:
    """What ``llmft compile``, ``llmft plan`` and the banner say of an online-RL run: how the batch
    counts (prompts x G completions), generation's KV cache per rank, and the reference."""
    r, b, reference = plan.recipe, plan.batch, plan.reference
    G = plan.objective_spec.group_size(r)
    lines = [
        f"completions: {b.global_batch_size // G} prompts per step x G {G} = {b.global_batch_size} "
        f"= micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} x data-parallel {b.dp_size}"
    ]
    shape = model_shape(r.model)
    known = shape is not None and isinstance(r.data.max_seq_len, int)
    kv = generation_kv(r, plan.objective_spec, shape, b.local_batch_size) if known else None
    if kv is not None:  # rollout.backend hf
        lines.append(
            f"generation ({r.rollout.backend}): KV cache up to {kv.nbytes / 2**30:.2f} GiB per rank ({kv.rows} "
            f"completions x {kv.tokens} tokens), {r.rollout.max_new_tokens} new tokens each"
        )
    reference = {
        "none": "none (rl.beta 0)",
        "adapters_disabled": "the policy with its adapters disabled",
        "frozen_copy": "a frozen copy of the initial weights, sharded like the policy",
    }.get(reference, reference)
    lines.append(f"reference: {reference}; rl.normalise {r.rl.normalise}, rl.iterations {r.rl.iterations}")
    return lines


def card_words(spec: ObjectiveSpec, recipe: dict) -> str:
    """The model card's words: the record's ``card``, then its rollout, loss and rewards."""
    r, rl = recipe.get("rollout") or {}, recipe.get("rl") or {}
    rewards = ", ".join(
        f"{e.get('function') or e.get('model')} x {e.get('weight', 1.0)}" for e in recipe.get("rewards") or []
    )
    return (
        f"{spec.card}; G {r.get('num_generations')}, max_new_tokens {r.get('max_new_tokens')}, temperature "
        f"{r.get('temperature')}, beta {rl.get('beta')}, epsilon {rl.get('epsilon')}"
        + (f"/{rl['epsilon_high']}" if rl.get("epsilon_high") is not None else "")
        + f", normalise {rl.get('normalise')}, scale_rewards {rl.get('scale_rewards')}, iterations "
        f"{rl.get('iterations')}; rewards: {rewards}"
    )


@dataclass(frozen=True)
class GenerationKV:
    """The KV cache of one generate() call on a rank (transformers' cache: a key and a value of
    ``kv_heads x head_dim`` per token, layer and row, in the compute dtype)."""

    rows: int  # completions generated together (``rollout.batch_size``, at most the rank's local batch)
    tokens: int  # per row: the prompt room plus rollout.max_new_tokens, i.e. data.max_seq_len
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.tokens * self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (
            f"{self.rows} completions x {self.tokens} tokens x {self.layers} layers x 2 x {self.kv_heads} kv heads "
            f"x {self.head_dim} x {self.dtype_bytes} bytes"
        )


def generation_kv(recipe: Recipe, spec: ObjectiveSpec, shape: ModelShape, local: int) -> GenerationKV | None:
    """The KV cache of an objective that generates with the policy (it reads ``rollout``, whose backend
    is ``hf``) for ``local`` completions per rank and step; None for every other run.

    Every rank generates its ``local`` completions (each prompt repeated once per completion, rows
    of the step's order) in generate() calls of ``rollout.batch_size`` rows (all at once when
    unset), left-padded to the longest prompt: at most ``data.max_seq_len - rollout.max_new_tokens``
    tokens of prompt, then ``rollout.max_new_tokens`` new ones, ``data.max_seq_len`` per row in all.
    Not counted: the prefill's one-layer working set and the last token's logits (small beside
    the cache at a long context)."""
    if not spec.reads_from("rollout") or recipe.rollout.backend != "hf":
        return None
    rows = min(recipe.rollout.batch_size or local, local)
    a = DTYPE_BYTES[recipe.model.dtype]
    return GenerationKV(rows, recipe.data.max_seq_len, shape.num_layers, shape.num_kv_heads, shape.head_dim, a)


def importance_correction(recipe: Recipe) -> str:
    """``rl.importance_correction`` resolved: none unless asked (the ``hf`` backend samples from the
    trainer's own weights; a vLLM backend would default to tis)."""
    return recipe.rl.importance_correction or "none"
