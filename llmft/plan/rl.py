"""Online RL's plan-side pieces (``rollout.*``, ``rl.*``, ``rewards``): pure, no torch.

GRPO's record (``plan/objectives.py``) names them and the generic code calls them through it:
``rl_problems``, its recipe checks (``ObjectiveSpec.problems``); ``rl_lines``, what ``llmft
compile``, ``llmft plan`` and the banner print under the batch line (``summary``); ``card_words``,
its model-card words. A step holding whole groups of G completions is the record's ``group``,
checked once the batch is solved (``objectives.group_problems``); a recipe that sets these keys
for an objective that does not read them is refused there too (``objectives.unread_problems``).
``reward_entries`` (``parse_rewards``: its short form), ``reward_problems``, ``sandbox_of`` and
``import_function`` read ``rewards`` for the runtime (``objectives/rewards.py``).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from llmft.errors import Problem, UserError
from llmft.limits import REWARD_TIMEOUT_S
from llmft.plan.deepspeed import DTYPE_BYTES
from llmft.plan.objectives import objective_of
from llmft.plan.shape import ModelShape, model_shape, reward_model_problems
from llmft.plan.vllm import vllm_problems
from llmft.scoring import probe
from llmft.scoring.probe import BUILTINS, INSTALL, SANDBOXED

if TYPE_CHECKING:
    from llmft.plan.layout import RunPlan
    from llmft.plan.objectives import ObjectiveSpec
    from llmft.recipe.schema import Recipe


KINDS = ("function", "model", "builtin")  # what scores: exactly one per entry of ``rewards``
ON_TIMEOUT = ("none", "error")
SANDBOXES = ("bwrap", "none")
_KEYS = (*KINDS, "weight", "timeout_s", "on_timeout", "sandbox")
_EXAMPLE = '{function: "my_rewards:exact", weight: 1.0}, {builtin: math_verify} or {model: DIR}'


@dataclass(frozen=True)
class RewardEntry:
    """One entry of ``rewards`` as written: what scores (``kind`` and ``what``: "module:name", a
    directory, or a built-in's name), its weight, and for a function or built-in the deadline of a
    call (None: ``REWARD_TIMEOUT_S``), what a call past it is (``none``: no opinion; ``error``: the run
    stops) and its sandbox (None: the kind's default, ``sandbox_of``)."""

    kind: str
    what: str
    weight: float = 1.0
    timeout_s: float | None = None
    on_timeout: str = "none"
    sandbox: str | None = None


def reward_entries(entries: list[Any]) -> list[RewardEntry]:
    """Every entry of ``rewards`` read and checked; a UserError naming ``rewards[i].key`` for each bad one."""
    out, problems = [], []
    for i, entry in enumerate(entries):
        where = f"rewards[{i}]"
        if not hasattr(entry, "items"):
            problems.append(Problem(where, f"is {entry!r}", f"Write one mapping per reward: {_EXAMPLE}."))
            continue
        entry = dict(entry.items())
        kinds = [k for k in KINDS if entry.get(k) is not None]
        found = []
        for unknown in sorted(set(entry) - set(_KEYS), key=str):
            close = difflib.get_close_matches(str(unknown), _KEYS, n=1)
            hint = f"Did you mean {close[0]}? " if close else ""
            found.append(
                Problem(f"{where}.{unknown}", "is not a key of a reward", f"{hint}A reward's keys: {', '.join(_KEYS)}.")
            )
        if len(kinds) != 1:
            found.append(
                Problem(
                    where,
                    f"needs exactly one of function, model and builtin (it has {', '.join(kinds) or 'none'})",
                    f"e.g. {_EXAMPLE}",
                )
            )
            problems += found
            continue
        kind = kinds[0]
        what = str(entry[kind])
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            found.append(Problem(f"{where}.weight", f"is {weight!r}", "Use a finite number."))
        if kind == "function" and (":" not in what or not all(what.partition(":")[::2])):
            found.append(
                Problem(
                    f"{where}.function",
                    f"is {what!r}, not module:name",
                    'Name a module and a function: "my_rewards:exact".',
                )
            )
        if kind == "builtin" and what not in BUILTINS:
            found.append(
                Problem(
                    f"{where}.builtin", f"is {what!r}, not a built-in reward", f"Use one of: {', '.join(BUILTINS)}."
                )
            )
        timeout_s, on_timeout, sandbox = entry.get("timeout_s"), entry.get("on_timeout"), entry.get("sandbox")
        if kind == "model":
            for name in ("timeout_s", "on_timeout", "sandbox"):
                if entry.get(name) is not None:
                    found.append(
                        Problem(
                            f"{where}.{name}",
                            "is set, but a reward model runs in the training process, in one batch per step",
                            f"Remove {name} from this entry; it applies to a function or a builtin.",
                        )
                    )
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf
        ):
            found.append(
                Problem(
                    f"{where}.timeout_s",
                    f"is {timeout_s!r}",
                    f"Use the seconds a call may take, above 0 (default {REWARD_TIMEOUT_S:g}).",
                )
            )
        if on_timeout is not None and on_timeout not in ON_TIMEOUT:
            found.append(
                Problem(
                    f"{where}.on_timeout",
                    f"is {on_timeout!r}",
                    "Use none (a call past its deadline is no opinion, counted in reward_timeouts/<name>) "
                    "or error (the run stops).",
                )
            )
        if sandbox is not None and sandbox not in SANDBOXES:
            found.append(
                Problem(
                    f"{where}.sandbox",
                    f"is {sandbox!r}",
                    "Use bwrap (bubblewrap: no network, a read-only file system, a private /tmp) or none.",
                )
            )
        if found:
            problems += found
            continue
        out.append(
            RewardEntry(
                kind,
                what,
                float(weight),
                None if timeout_s is None else float(timeout_s),
                on_timeout or "none",
                sandbox,
            )
        )
    if problems:
        raise UserError(*problems)
    return out


def parse_rewards(entries: list[Any]) -> list[tuple[str, str, float]]:
    """(kind ``function`` | ``model`` | ``builtin``, what, weight) per entry of ``rewards``
    (``reward_entries``, less the call settings); a UserError naming ``rewards[i]`` for each bad one."""
    return [(e.kind, e.what, e.weight) for e in reward_entries(entries)]


def sandbox_of(entry: RewardEntry, workers: int) -> str:
    """Where ``entry``'s code runs: ``bwrap`` or ``none``. Its ``sandbox`` when set; unset, code_tests
    runs each test in bubblewrap (required: ``reward_problems`` refuses it where bubblewrap does not
    work), and a function or math_verify runs its worker in bubblewrap where it works here (else
    unconfined), or in the training process with ``rl.reward_workers`` 0."""
    if entry.sandbox is not None:
        return entry.sandbox
    if entry.kind == "builtin" and entry.what in SANDBOXED:
        return "bwrap"
    return "bwrap" if workers > 0 and probe.bwrap_problem() is None else "none"


def reward_problems(entries: list[RewardEntry], workers: int) -> list[Problem]:
    """What the call settings of ``rewards`` cannot do with ``rl.reward_workers`` ``workers`` here:
    a deadline or a sandboxed worker without workers, a sandbox bubblewrap cannot make on this
    machine, a built-in whose package is missing."""
    problems = []
    for i, e in enumerate(entries):
        where = f"rewards[{i}]"
        if e.kind == "model":
            continue
        runs_code = e.kind == "builtin" and e.what in SANDBOXED
        if workers == 0:
            for name, value in (("timeout_s", e.timeout_s), ("on_timeout", e.on_timeout != "none" or None)):
                if value is not None:
                    problems.append(
                        Problem(
                            f"{where}.{name}",
                            "is set, but rl.reward_workers is 0: a call in the training process cannot be stopped",
                            f"Set rl.reward_workers to 1 or more (each call then has a deadline), or remove {name}.",
                        )
                    )
            if e.sandbox == "bwrap" and not runs_code:
                problems.append(
                    Problem(
                        f"{where}.sandbox",
                        "is bwrap, but rl.reward_workers is 0: a function in the training process runs unconfined",
                        "Set rl.reward_workers to 1 or more (each worker then runs in the sandbox), or sandbox: none.",
                    )
                )
        if sandbox_of(e, workers) == "bwrap" and (workers > 0 or runs_code) and (why := probe.bwrap_problem()):
            what = "runs the completions' code" if runs_code else "runs its worker"
            problems.append(
                Problem(
                    f"{where}.sandbox" if e.sandbox else where,
                    f"{e.what} {what} in a bubblewrap sandbox, but {why}",
                    f"Install bubblewrap (`{INSTALL}`; it needs unprivileged user namespaces, or root), or set "
                    f"{where}.sandbox: none to run "
                    + (
                        "the completions' code unconfined (only where losing the machine to it is acceptable)."
                        if runs_code
                        else "it unconfined."
                    ),
                )
            )
        if e.kind == "builtin" and e.what == "math_verify" and importlib.util.find_spec("math_verify") is None:
            problems.append(
                Problem(
                    f"{where}.builtin",
                    "is math_verify, but the math-verify package is not installed",
                    'Install it: `pip install "llmft[rewards]"` (or `pip install "math-verify>=0.7"`).',
                )
            )
    return problems


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


def environments_of(value: Any) -> dict[str | None, str]:
    """``rollout.environment`` as {name: "module:Class"} (None: one class for every record); a
    ``UserError`` where it is neither a "module:Class" nor a mapping of names to them."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {None: value}
    if hasattr(value, "items") and value and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return {k: v for k, v in value.items()}
    raise UserError(
        Problem(
            "rollout.environment",
            f"is {str(value)[:200]}, not a class or a mapping of names to classes",
            'Write "module:Class", or {name: "module:Class", ...} (each record\'s environment field picks one).',
        )
    )


def agent_problems(recipe: Recipe) -> list[Problem]:
    """What ``rollout.tools`` / ``rollout.environment`` (multi-turn episodes) cannot do: the tools and
    classes that cannot be imported, the bounds, and the backends and modes that do not generate them."""
    r = recipe.rollout
    problems: list[Problem] = []
    if r.max_turns < 1:
        problems.append(Problem("rollout.max_turns", f"is {r.max_turns}", "Use 1 or more."))
    if r.max_tool_calls is not None and r.max_tool_calls < 0:
        problems.append(Problem("rollout.max_tool_calls", f"is {r.max_tool_calls}", "Use 0 or more, or null."))
    if not (r.tools or r.environment):
        return problems
    key = "rollout.tools" if r.tools else "rollout.environment"
    if r.backend == "file":
        problems.append(
            Problem(
                key,
                "is set, but rollout.backend is file: a file's episodes are replayed, no tool is called",
                "Use rollout.backend=hf or vllm to generate episodes, or drop the key to replay the file's.",
            )
        )
    if getattr(r, "async") == 1:
        problems.append(
            Problem(
                key, "is set with rollout.async=1: multi-turn episodes are generated in step", "Use rollout.async=0."
            )
        )
    if r.tool_timeout_s is not None and not r.tool_timeout_s > 0:
        problems.append(Problem("rollout.tool_timeout_s", f"is {r.tool_timeout_s}", "Use seconds above 0, or null."))
    targets = [(f"rollout.tools[{i}]", t) for i, t in enumerate(r.tools)]
    try:
        named = environments_of(r.environment)
    except UserError as e:
        problems += e.problems
        named = {}
    targets += [("rollout.environment" + (f".{n}" if n is not None else ""), t) for n, t in named.items()]
    for where, target in targets:
        try:
            import_function(target, where)
        except UserError as e:
            problems += e.problems
    return problems


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
    if r.backend == "vllm":
        problems += vllm_problems(recipe, where)
    if getattr(r, "async") == 1 and r.backend != "vllm":
        bad(
            "rollout.async",
            f"is 1, but rollout.backend is {r.backend}: only a separate engine generates while the policy updates",
            "Use rollout.backend=vllm, or rollout.async=0.",
        )
    if getattr(r, "async") == 1 and rl.iterations > 1:
        bad(
            "rollout.async",
            f"is 1 with rl.iterations {rl.iterations}: the next generation batch is generated during one update, "
            "not several",
            "Use rl.iterations=1 with rollout.async=1.",
        )
    if importance_correction(recipe) == "tis" and r.backend == "file":
        bad(
            "rl.importance_correction",
            "is tis, but rollout.backend is file: a file's completions come without the sampler's log-probs",
            "Set rl.importance_correction=none, or generate with rollout.backend=hf or vllm.",
        )
    problems += [Problem(where(p.where), p.what, p.fix) for p in agent_problems(recipe)]
    if not recipe.rewards and not recipe.rollout.environment:  # an environment's get_reward may score
        bad(
            "rewards",
            "is empty: nothing scores the completions",
            'Add {function: "module:name", weight: 1.0} or {model: DIR}.',
        )
    if rl.reward_workers < 0:
        bad(
            "rl.reward_workers",
            f"is {rl.reward_workers}",
            "Use 1 or more (worker processes per reward, each call with a deadline), or 0 (in the training process).",
        )
    try:
        entries = reward_entries(list(recipe.rewards))
    except UserError as e:
        entries = []
        problems += [Problem(where(p.where), p.what, p.fix) for p in e.problems]
    found = reward_problems(entries, max(rl.reward_workers, 0))
    problems += [Problem(where(p.where), p.what, p.fix) for p in found]
    for i, e in enumerate(entries):  # every function that cannot be had, not the first only
        if e.kind == "model":  # a reward model dir without a trained score head: before the policy loads
            found = reward_model_problems(e.what, f"rewards[{i}].model")
            problems += [Problem(where(p.where), p.what, p.fix) for p in found]
        elif e.kind == "function":
            try:
                import_function(e.what, f"rewards[{i}].function")
            except UserError as err:
                problems += [Problem(where(p.where), p.what, p.fix) for p in err.problems]
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
    if r.rollout.backend == "vllm":
        v = r.rollout.vllm
        tp = v.tensor_parallel_size
        if v.mode == "server":
            where = f"the rollout server at {v.url}"
        elif tp > 1:
            where = f"one engine across every {tp} consecutive training processes (tensor parallel {tp})"
        else:
            where = "an engine in every training process"
        staleness = (
            "async: step k+1's completions are generated during step k's update, from the weights before it "
            "(staleness 1 step)"
            if getattr(r.rollout, "async") == 1
            else "staleness 0 steps"
        )
        lines.append(
            f"generation (vllm, {v.mode}): {where}, the weights synced before every generation; {staleness}; "
            f"rl.importance_correction {importance_correction(r)}"
        )
    if r.rollout.tools or r.rollout.environment:
        rr = r.rollout
        what = [f"tools {', '.join(t.partition(':')[2] or t for t in rr.tools)}"] if rr.tools else []
        try:
            named = environments_of(rr.environment)
        except UserError:
            named = {}
        what += [f"environment {', '.join(t.partition(':')[2] or t for t in named.values())}"] if named else []
        calls = f", {rr.max_tool_calls} tool calls" if rr.max_tool_calls is not None else ""
        lines.append(
            f"episodes: {'; '.join(what)}; at most {rr.max_turns} turns{calls} and {rr.max_new_tokens} tokens "
            "each (the policy's and the tools'; only the policy's trained)"
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
        f"{e.get('function') or e.get('builtin') or e.get('model')} x {e.get('weight', 1.0)}"
        for e in recipe.get("rewards") or []
    )
    return (
        f"{spec.card}; G {r.get('num_generations')}, max_new_tokens {r.get('max_new_tokens')}, temperature "
        f"{r.get('temperature')}, beta {rl.get('beta')}, epsilon {rl.get('epsilon')}"
        + (f"/{rl['epsilon_high']}" if rl.get("epsilon_high") is not None else "")
        + f", normalise {rl.get('normalise')}, scale_rewards {rl.get('scale_rewards')}, iterations "
        f"{rl.get('iterations')}; rewards: {rewards}" + _episode_words(r)
    )


def _episode_words(rollout: dict) -> str:
    """The model card's words on multi-turn episodes (tools, environments), or nothing."""
    tools, env = rollout.get("tools") or [], rollout.get("environment")
    if not (tools or env):
        return ""
    envs = ", ".join(env.values()) if isinstance(env, dict) else env
    parts = [f"tools {', '.join(tools)}"] * bool(tools) + [f"environment {envs}"] * bool(env)
    return f"; multi-turn episodes ({'; '.join(parts)}; at most {rollout.get('max_turns')} turns)"


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
    """``rl.importance_correction`` resolved: tis with the ``vllm`` backend (another engine samples),
    none otherwise unless asked (the ``hf`` backend samples from the trainer's own weights)."""
    if recipe.rl.importance_correction is not None:
        return recipe.rl.importance_correction
    return "tis" if recipe.rollout.backend == "vllm" else "none"
