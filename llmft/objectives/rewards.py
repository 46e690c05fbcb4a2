"""The rewards of online RL (``rewards:`` in the recipe): functions the user names, and reward models.

Each entry of ``rewards`` is one column of a completion's reward vector; the reward a completion
trains on is the weighted sum of its columns.

- ``{function: "module:name", weight}``: a Python function called once per completion as
  ``fn(prompt=..., completion=..., **fields)``: the prompt as the record holds it (text or
  messages), the completion's text, and the record's other fields by name (a function takes what it
  needs and ``**kwargs`` for the rest). For a multi-turn episode (``rollout.file``,
  ``llmft.objectives.episodes``) ``completion`` is the text of its last assistant message and
  ``completion_messages`` the whole episode (the messages after the prompt); a single completion
  gets no ``completion_messages``. It returns a float, or None: no opinion, counted as 0 in the
  weighted sum (TRL's convention for a function that does not apply to a record). A function that
  raises or returns NaN stops the run with its name and the record's prompt; nothing trained is
  lost (the last checkpoint stands).
- ``{model: DIR, weight}``: a sequence-classification model with one label (``train.objective:
  reward`` exports one), scoring prompt + completion + eos (as it saw pairs in training) with its
  own tokenizer (the policy's when DIR has none). In eval mode and without grad, never trained here;
  held as the engine holds the policy's weights (``place``: ``Engine.place_frozen``): sharded like it
  under FSDP2 and ZeRO-3, a whole copy on each rank otherwise. A DIR whose score head is not trained (a causal LM's
  directory, weights without ``score.weight``, more than one label) is refused, naming what is missing,
  when the recipe is checked (before the policy is built) and again when it loads.

- ``{builtin: math_verify | code_tests, weight}``: a built-in function (``llmft.scoring.builtin_rewards``),
  scored as a function is; its column is its name.

With ``rl.reward_workers`` >= 1 (default 2) every function and built-in runs in a pool of that many
worker processes of its own (``llmft.scoring.pool``), in a bubblewrap sandbox or not
(``rewards[i].sandbox``, ``llmft.plan.rl.sandbox_of``), each call with a deadline (``timeout_s``):
a call past it is killed with its worker and is None, counted in ``reward_timeouts/<name>``, or with
``on_timeout: error`` stops the run; a worker that dies in a call (a limit, a crash) is the same,
counted in ``reward_failures/<name>``. What a call returns or raises reads as it does in process:
the same messages, the same file:line. With 0 they run here, one call at a time, unbounded.

The functions are imported when the objective is built, so an unknown ``module:name`` is refused
before the first step, naming ``rewards[i].function``.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llmft import stop
from llmft.errors import Problem, UserError, library_problem
from llmft.job.dist import all_reduce_sum, cut_short
from llmft.limits import REWARD_TIMEOUT_S
from llmft.plan.objectives import REWARD_FAILURES, REWARD_TIMEOUTS
from llmft.plan.rl import RewardEntry, import_function, reward_entries, reward_problems, sandbox_of
from llmft.plan.shape import REWARD_FIX, reward_model_problems, weights_problems
from llmft.scoring.builtin_rewards import make_builtin
from llmft.scoring.pool import Outcome, WorkerPool, WorkerStartError
from llmft.scoring.worker import finite_reward, shown_value

# The arguments a reward function gets from llmft; a record field of one of these names is not passed
# (a record's own ``completion``, e.g. an SFT file's answer: rename it with the source's ``fields``).
RESERVED = ("prompt", "completion", "completion_messages")
log = logging.getLogger("llmft")
# How a frozen model built whole is held (``Engine.place_frozen``): on the device, or sharded.
Place = Callable[[torch.nn.Module], torch.nn.Module]


@dataclass
class RewardSpec:
    """One entry of ``rewards``: where it is in the recipe, its weight, and what scores."""

    key: str  # rewards[i].function, rewards[i].builtin or rewards[i].model
    name: str  # the column's metric name: the function's or built-in's name, or the model dir's last part
    weight: float
    function: Callable[..., Any] | None = None
    model: Any = None  # (model, tokenizer)
    entry: RewardEntry | None = None
    pool: WorkerPool | None = None  # rl.reward_workers >= 1: where the function's calls run
    sandbox: str = "none"  # bwrap | none: where its code runs (the worker, or code_tests' test processes)
    episode: bool = False  # an environment's get_reward(), given with each episode (llmft.objectives.agent)


def load_reward_model(
    path: str, key: str, device: torch.device, tokenizer: Any, hub_kernels: bool, place: Place | None = None
) -> tuple[Any, Any]:
    """A one-label sequence-classification model and its tokenizer (the policy's when DIR has none),
    frozen, on ``device``, or as ``place`` puts it (the engine's ``place_frozen``: sharded like the policy).

    Refused, naming ``path`` and what is missing, unless its score head is trained: a directory is read
    first (``reward_model_problems``: config and safetensors headers, nothing allocated; the recipe
    check read it too, before the policy was built), and any weight transformers reports it had to
    initialise fresh (a hub model's score head, a .bin checkpoint's) refuses the loaded model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    problems = reward_model_problems(path, key)
    try:
        if not problems:  # the sizes the family's defaults fill in, against the weight files beside them
            config = AutoConfig.from_pretrained(path)
            local = Path(path).expanduser() / "config.json"
            found = weights_problems(config.to_dict(), local) if local.is_file() else []
            problems = [Problem(key, str(Problem(p.where, p.what)), p.fix) for p in found]
        if problems:
            raise UserError(*problems)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, use_kernels=hub_kernels, output_loading_info=True
        )
    except UserError:
        raise
    except Exception as e:
        raise UserError(library_problem(key, f"cannot load reward model {path!r}", e, name=path)) from e
    fresh = sorted(info.get("missing_keys") or ())
    if fresh:
        raise UserError(
            Problem(
                key,
                f"the weights of reward model {path!r} hold no {', '.join(fresh[:3])}"
                f"{', ...' if len(fresh) > 3 else ''}: transformers initialised {'it' if len(fresh) == 1 else 'them'} "
                "fresh, and GRPO would train on the scores of those random weights",
                REWARD_FIX,
            )
        )
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = tokenizer  # a reward model exported without its tokenizer shares the policy's
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    if place is not None:
        return place(model), tok
    model.to(device).eval().requires_grad_(False)
    return model, tok


class Rewards:
    """Every reward of the recipe, scoring completions into a ``[n, columns]`` float64 tensor."""

    def __init__(
        self,
        entries: list[Any],
        device: torch.device,
        tokenizer: Any,
        hub_kernels: bool = False,
        place: Place | None = None,
        workers: int = 0,
        environments: tuple[str, ...] = (),
    ) -> None:
        parsed = reward_entries(entries)
        problems = reward_problems(parsed, workers)
        if problems:
            raise UserError(*problems)
        self.specs: list[RewardSpec] = []
        for i, entry in enumerate(parsed):
            key, what, sandbox = f"rewards[{i}].{entry.kind}", entry.what, sandbox_of(entry, workers)
            if entry.kind == "model":
                model = load_reward_model(what, key, device, tokenizer, hub_kernels, place)
                self.specs.append(RewardSpec(key, what.rstrip("/").rsplit("/", 1)[-1], entry.weight, model=model))
                continue
            timeout_s = entry.timeout_s or REWARD_TIMEOUT_S
            if entry.kind == "function":
                fn, name, target = import_function(what, key), what.partition(":")[2], {"function": what}
            else:
                options = {"timeout_s": timeout_s if workers else None, "sandbox": sandbox}
                fn, name, target = make_builtin(what, **options), what, {"builtin": what, "options": options}
            spec = RewardSpec(key, name, entry.weight, function=fn, entry=entry, sandbox=sandbox)
            if workers > 0:  # a code_tests worker runs unconfined: each test it runs is sandboxed itself
                confined = sandbox == "bwrap" and "builtin" not in target
                spec.pool = WorkerPool(target, workers, timeout_s, confined)
            self.specs.append(spec)
        for name in environments:  # the environments' get_reward(), weight 1 (TRL's)
            self.specs.append(RewardSpec("rollout.environment", name, 1.0, episode=True))
        if not self.specs:
            raise UserError(
                Problem(
                    "rewards",
                    "is empty and no environment of rollout.environment has get_reward(): nothing scores the episodes",
                    'Add {function: "module:name", weight: 1.0}, or give the environment class a get_reward method.',
                )
            )
        self.device = device  # where the stop vote's all-reduce runs (``score``)
        self.weights = torch.tensor([s.weight for s in self.specs], dtype=torch.float64)
        self.names = tuple(unique_names([s.name for s in self.specs]))
        # per column, the calls of the last ``score`` that timed out / whose worker died
        self.timeouts = [0] * len(self.specs)
        self.failures = [0] * len(self.specs)
        self._warned: set[tuple[int, str]] = set()

    def score(
        self,
        prompts: list[Any],
        completions: list[str],
        records: list[dict[str, Any]],
        messages: list[list[dict[str, Any]] | None] | None = None,
        episode_rewards: list[dict[str, float | None]] | None = None,
    ) -> torch.Tensor:
        """``[n, columns]``: each completion's reward by each entry (None -> NaN in the matrix, 0 in the sum).

        Every rank calls it once per step (and per eval). A stop request ends the scoring before
        the next call of a function or model (calls in workers are dropped); then every rank votes
        (``llmft.job.dist.cut_short``) and, if any was asked to stop, all raise ``stop.Abandoned``: a
        step is never trained on part of its rewards. A single call in this process that blocks is
        not interrupted; one in a worker ends at its deadline. ``messages``: per completion, the
        multi-turn episode it is the last message of (passed as ``completion_messages``), or None;
        ``episode_rewards``: per completion, its environment's reward by column (``episode`` columns)."""
        columns = []
        episodes = messages if messages is not None else [None] * len(records)
        records = [  # a record's own completion_messages field is reserved: never passed
            {**{k: v for k, v in r.items() if k != "completion_messages"}, **({"completion_messages": m} if m else {})}
            for r, m in zip(records, episodes, strict=True)
        ]
        self.timeouts = [0] * len(self.specs)
        self.failures = [0] * len(self.specs)
        with stop.during(stop.GENERATING):
            for c, spec in enumerate(self.specs):
                if stop.requested() is not None:
                    break
                if spec.episode:
                    given = episode_rewards or [{}] * len(completions)
                    values = [math.nan if r.get(spec.name) is None else float(r[spec.name]) for r in given]  # type: ignore[arg-type]
                    columns.append(torch.tensor(values, dtype=torch.float64))
                elif spec.pool is not None:
                    columns.append(self._pooled(c, spec, prompts, completions, records))
                elif spec.function is not None:
                    columns.append(self._call(spec, prompts, completions, records))
                else:
                    columns.append(self._model_scores(spec, prompts, completions))
            cut_short("scoring", self.device)
        return torch.stack(columns, dim=1) if columns else torch.zeros(len(completions), 0, dtype=torch.float64)

    def event_metrics(self, device: torch.device | None = None) -> dict[str, float]:
        """``reward_timeouts/<name>`` and ``reward_failures/<name>`` of each column run in workers: its
        calls of the last ``score`` past their deadline, and those whose worker died, summed over the
        ranks (one all-reduce; every rank calls it, or none: the recipe decides)."""
        pooled = [c for c, spec in enumerate(self.specs) if spec.pool is not None]
        if not pooled:
            return {}
        sums = all_reduce_sum(
            [float(self.timeouts[c]) for c in pooled] + [float(self.failures[c]) for c in pooled],
            device or self.device,
        )
        out = {f"{REWARD_TIMEOUTS}{self.names[c]}": sums[k] for k, c in enumerate(pooled)}
        out.update({f"{REWARD_FAILURES}{self.names[c]}": sums[len(pooled) + k] for k, c in enumerate(pooled)})
        return out

    def close(self) -> None:
        """Stop the workers (and whatever they started)."""
        for spec in self.specs:
            if spec.pool is not None:
                spec.pool.close()

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum per completion; a None (NaN in ``scores``) counts 0."""
        return (torch.nan_to_num(scores, nan=0.0) * self.weights).sum(dim=1)

    def _call(self, spec: RewardSpec, prompts: list[Any], completions: list[str], records: list[dict]) -> torch.Tensor:
        out = torch.full((len(completions),), math.nan, dtype=torch.float64)
        for j, (prompt, completion, record) in enumerate(zip(prompts, completions, records, strict=True)):
            if stop.requested() is not None:  # ``score`` votes next: the step is abandoned
                break
            fields = _fields(record)
            try:
                value = spec.function(prompt=prompt, completion=completion, **fields)  # type: ignore[misc]
            except Exception as e:
                raise UserError(
                    _bad_reward(spec, prompt, f"raised {type(e).__name__}: {e}", _where(spec.function))
                ) from e
            if value is None:
                out[j] = math.nan
                continue
            if not finite_reward(value):
                raise UserError(_bad_reward(spec, prompt, f"returned {shown_value(value)}", _where(spec.function)))
            out[j] = float(value)
        return out

    def _pooled(
        self, c: int, spec: RewardSpec, prompts: list[Any], completions: list[str], records: list[dict]
    ) -> torch.Tensor:
        """Column ``c`` from its workers: the outcomes read as ``_call`` reads a call here, and a
        deadline passed or a worker lost as ``on_timeout`` says."""
        assert spec.pool is not None and spec.entry is not None
        out = torch.full((len(completions),), math.nan, dtype=torch.float64)
        calls = [
            {"prompt": p, "completion": t, **_fields(r)} for p, t, r in zip(prompts, completions, records, strict=True)
        ]
        outcomes = spec.pool.run(calls, lambda: stop.requested() is not None)
        try:
            for o in outcomes:
                if o.kind == "value":
                    out[o.index] = math.nan if o.value is None else o.value
                elif o.kind == "bad":
                    raise UserError(_bad_reward(spec, prompts[o.index], f"returned {o.text}", _where(spec.function)))
                elif o.kind == "raised":
                    where = _where(spec.function)
                    raise UserError(_bad_reward(spec, prompts[o.index], f"raised {o.text}", where, _raised_fix(spec)))
                else:
                    self._missed(c, spec, o, prompts[o.index])
        except WorkerStartError as e:
            raise UserError(_no_worker(spec, str(e))) from e
        finally:
            outcomes.close()  # an error or a stop: the calls still running are killed
        return out

    def _missed(self, c: int, spec: RewardSpec, o: Outcome, prompt: Any) -> None:
        """A call past its deadline, or whose worker died: no opinion and counted, or the run stops."""
        assert spec.entry is not None and spec.pool is not None
        timeout_s = spec.pool.timeout_s
        if o.kind == "timeout":
            self.timeouts[c] += 1
            what, metric = f"did not answer within timeout_s {timeout_s:g} s", REWARD_TIMEOUTS
        else:
            self.failures[c] += 1
            what, metric = f"failed: {o.text}", REWARD_FAILURES
        entry = spec.key.rsplit(".", 1)[0]
        if spec.entry.on_timeout == "error":
            raise UserError(
                _bad_reward(
                    spec,
                    prompt,
                    what,
                    _where(spec.function),
                    f"Make the reward answer within its deadline (raise {entry}.timeout_s, or on_timeout: none "
                    "to count such a call as no opinion), then run again: checkpoint.resume=auto continues from "
                    "the last checkpoint.",
                )
            )
        if (c, o.kind) not in self._warned:  # once per column and kind; the metric counts every one
            self._warned.add((c, o.kind))
            shown = _shown(prompt)
            log.warning(
                "%s: %s %s for the record with prompt %r; such a call counts as no opinion (None), "
                "counted per step in %s%s (%s.on_timeout: error stops the run instead)",
                spec.key,
                spec.name,
                what,
                shown,
                metric,
                self.names[c],
                entry,
            )

    @torch.no_grad()
    def _model_scores(self, spec: RewardSpec, prompts: list[Any], completions: list[str]) -> torch.Tensor:
        model, tok = spec.model
        # as a reward model trained on pairs saw them (docs/preference.md): prompt + completion, eos
        rows = [
            tok(_prompt_text(p, tok) + c)["input_ids"] + [tok.eos_token_id]
            for p, c in zip(prompts, completions, strict=True)
        ]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # right-padded: the score is read at each row's last real token
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        scores = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits[:, 0].double().cpu()
        if not torch.isfinite(scores).all():
            j = int((~torch.isfinite(scores)).nonzero()[0])
            raise UserError(_bad_reward(spec, prompts[j], f"scored {float(scores[j])}", spec.key))
        return scores


def _fields(record: dict[str, Any]) -> dict[str, Any]:
    """A reward function's keyword arguments from ``record`` (besides prompt and completion): its
    fields but the reserved names, and the episode ``score`` put under ``completion_messages``."""
    fields = {k: v for k, v in record.items() if k not in RESERVED}
    if "completion_messages" in record:
        fields["completion_messages"] = record["completion_messages"]
    return fields


def _prompt_text(prompt: Any, tok: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def _where(fn: Any) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return getattr(fn, "__module__", "?")


def _shown(prompt: Any) -> str:
    shown = prompt if isinstance(prompt, str) else str(prompt)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def _bad_reward(spec: RewardSpec, prompt: Any, what: str, where: str, fix: str = "") -> Problem:
    return Problem(
        spec.key,
        f"{spec.name} ({where}) {what} for the record with prompt {_shown(prompt)!r}; no optimizer step was taken "
        "and the last checkpoint is untouched",
        fix
        or "Make the reward return a finite float (or None when it does not apply), then run again: "
        "checkpoint.resume=auto continues from the last checkpoint.",
    )


def _raised_fix(spec: RewardSpec) -> str:
    """What to do about a reward that raised in its worker (in a sandbox: what it cannot do there)."""
    assert spec.pool is not None
    fix = (
        "Make the reward return a finite float (or None when it does not apply), then run again: "
        "checkpoint.resume=auto continues from the last checkpoint."
    )
    if spec.pool.sandboxed:
        fix += (
            " It runs in a bubblewrap sandbox (no network, the file system read-only but for a private /tmp); "
            f"{spec.key.rsplit('.', 1)[0]}.sandbox: none runs it unconfined."
        )
    return fix


def _no_worker(spec: RewardSpec, why: str) -> Problem:
    assert spec.pool is not None
    entry = spec.key.rsplit(".", 1)[0]
    where = "a bubblewrap sandbox (the file system read-only, a private /tmp)" if spec.pool.sandboxed else "a process"
    fix = "Make the module importable by a fresh python (installed, or on PYTHONPATH)"
    if spec.pool.sandboxed:
        fix += f", or set {entry}.sandbox: none to run its worker unconfined"
    return Problem(spec.key, f"{spec.name}'s worker ({where}) could not start: {why}", fix + ".")


def unique_names(names: list[str]) -> list[str]:
    """Metric names of the reward columns: a repeated name gets its position (``exact``, ``exact_2``)."""
    out: list[str] = []
    for n in names:
        name, k = n, 2
        while name in out:
            name, k = f"{n}_{k}", k + 1
        out.append(name)
    return out
