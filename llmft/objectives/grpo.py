"""GRPO (``train.objective: grpo``): online RL from rewards, with the loss normalised over the global batch.

An item of the data is one completion: G consecutive positions of the global order are one prompt's
G completions (``ObjectiveSpec.group``; docs/data.md "Prompt records"), so the batch equation counts
completions and a group may lie on several ranks. The step, in ``prepare`` (before the loop counts
anything):

1. this rank's completions of its items, from the rollout backend (``llmft.objectives.rollout``);
2. their rewards (``llmft.objectives.rewards``), then one all-gather of (position, reward) rows over
   the data-parallel ranks: every group is whole before its advantages are taken, whichever ranks
   hold its completions. Advantage = reward - its group's mean, divided by the group's std
   (``rl.scale_rewards: group``), the global batch's (``batch``) or nothing (``none``), + 1e-4;
3. the update micro-batches, padding-free: each micro-batch's prompt + completion sequences in one
   packed row (position ids restart per sequence, ``sequence_index`` names each token's completion;
   labels only on completion tokens, and of a multi-turn episode only on its policy tokens: tool and
   environment tokens are context, ``llmft.objectives.episodes``), with the per-token old log-probs (``rl.iterations`` > 1: the
   policy's at generation time) and the reference's (``rl.beta`` > 0) computed without grad.

The loss of a micro-batch (``micro_loss``), per completion token t of completion i, with
ratio = exp(logp - old) (old = logp detached when ``rl.iterations`` is 1):

    l_t = -min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * ratio * k3_t,
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

(the KL term times the ratio, which is 1 in value: the k3 estimate's gradient under the policy that
sampled, TRL's default ``use_bias_correction_kl``)

summed with a weight per token and divided by the global count (``count``, summed over the step's
micro-batches and ranks by the loop): ``rl.normalise: global_token`` weight 1, count = completion
tokens of the global batch (TRL's ``dapo``); ``sequence`` weight 1 / len(completion i), count =
completions (TRL's ``grpo``); ``constant`` weight 1, count = completions x ``rollout.max_new_tokens``
(TRL's ``dr_grpo``). Any split of the global batch (micro x accumulation x ranks) is the same step.

With ``rl.iterations`` = k > 1 the data repeats each generation batch k times (docs/rl.md); the
first of those steps generates and keeps its prepared micro-batches, the others reuse them (same
completions, same old log-probs, the policy moved). The reference is the policy with its adapters
disabled (LoRA/QLoRA), a frozen copy of the initial weights (full fine-tune) or none (beta 0).
Dropout is off in the policy and the reference, as for preference objectives.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llmft.checkpoint.layout import COMPLETIONS_DIR, OBJECTIVE_DIR, STATE_FILE
from llmft.data.arrays import IGNORE_INDEX
from llmft.data.sampler import eval_shard
from llmft.errors import Problem, UserError
from llmft.job import watchdog
from llmft.job.dist import DistEnv, all_gather_rows, all_reduce_max, all_reduce_sum
from llmft.model import loss as lm_loss
from llmft.objectives import Models, ObjectiveBase, ObjectiveSetup, disable_dropout, model_inputs
from llmft.objectives.agent import AgentRollout
from llmft.objectives.episodes import Episode
from llmft.objectives.reference import frozen_reference
from llmft.objectives.rewards import Rewards
from llmft.objectives.rollout import Prompt, make_rollout
from llmft.objectives.sequences import predicted_targets
from llmft.plan.layout import RunPlan
from llmft.plan.objectives import ADAPTERS_DISABLED, NO_REFERENCE
from llmft.plan.rl import importance_correction
from llmft.recipe.schema import Recipe

STD_EPS = 1e-4  # added to the std that scales advantages (TRL's value)


def advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` ``[N]`` (N = groups x ``group``, each group consecutive)."""
    by_group = rewards.view(-1, group)
    centred = (by_group - by_group.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = (
            by_group.std(dim=1, keepdim=True).expand_as(by_group).reshape(-1)
            if group > 1
            else torch.zeros_like(rewards)
        )
        return centred / (std + STD_EPS)
    if scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        return centred / (std + STD_EPS)
    return centred


def token_logps(
    model: torch.nn.Module, batch: dict[str, Any], temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of the token each position predicts ``[R, T]``, the policy's entropy there or None),
    from ``model``'s forward on a packed update batch; logits divided by ``temperature`` as sampled."""
    target, _ = predicted_targets(batch["labels"], batch["sequence_index"])
    head = lm_loss.find(model)
    if head is not None and temperature == 1.0:  # the chunked head never holds the logits: no entropy
        with lm_loss.token_logps(head, target):
            return model(**model_inputs(batch), use_cache=False).logits, None
    logits = model(**model_inputs(batch), use_cache=False).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy.detach()


def _completion_tokens(batch: dict[str, Any]) -> list[torch.Tensor]:
    """Where each completion's tokens are predicted in the packed row (a bool mask ``[T]`` each)."""
    _, valid = predicted_targets(batch["labels"], batch["sequence_index"])
    index = batch["sequence_index"][0]
    return [valid[0] & (index == i) for i in range(int(batch["num_completions"]))]


def _place(batch: dict[str, Any], key: str, values: list[torch.Tensor]) -> None:
    """``batch[key]``: a row of the packed row's shape holding each completion's ``values`` where its
    tokens are predicted (``_completion_tokens``), 0 elsewhere."""
    row = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for mine, v in zip(_completion_tokens(batch), values, strict=True):
        row[0][mine] = v
    batch[key] = row


class Mismatch:
    """The sampler's log-probs against the trainer's old ones (``rl.importance_correction: tis``):
    each completion token's truncated importance weight min(exp(old - sampler), cap), and the
    step's sums for ``mismatch/*`` (over every rank's completion tokens)."""

    def __init__(self) -> None:
        self.abs_sum = self.kl_sum = self.weight_sum = self.tokens = self.capped = 0.0
        self.abs_max, self.weight_min, self.weight_max = 0.0, math.inf, 0.0

    def weights(self, batch: dict[str, Any], sampler: list[list[float]], cap: float) -> list[torch.Tensor]:
        out = []
        for mine, s in zip(_completion_tokens(batch), sampler, strict=True):
            diff = batch["old_logps"][0][mine].double() - torch.tensor(s, dtype=torch.float64)
            ratio = diff.exp()
            w = ratio.clamp(max=cap)
            if diff.numel():
                self.abs_sum += float(diff.abs().sum())
                self.abs_max = max(self.abs_max, float(diff.abs().max()))
                self.kl_sum += float((ratio - diff - 1).sum())  # k3: KL(sampler || trainer), sampled from the sampler
                self.weight_sum += float(w.sum())
                self.weight_min, self.weight_max = (
                    min(self.weight_min, float(w.min())),
                    max(self.weight_max, float(w.max())),
                )
                self.tokens += diff.numel()
                self.capped += float((ratio > cap).sum())
            out.append(w.float())
        return out

    def metrics(self, device: torch.device) -> dict[str, float]:
        """Over every rank's completion tokens (sums all-reduced, extremes by max)."""
        abs_sum, kl_sum, weight_sum, tokens, capped = all_reduce_sum(
            [self.abs_sum, self.kl_sum, self.weight_sum, self.tokens, self.capped], device
        )
        abs_max, neg_min, weight_max = all_reduce_max([self.abs_max, -self.weight_min, self.weight_max], device)
        n = max(tokens, 1.0)
        return {
            "mismatch/logp_abs_mean": abs_sum / n,
            "mismatch/logp_abs_max": abs_max,
            "mismatch/kl": kl_sum / n,
            "mismatch/is_weight_mean": weight_sum / n,
            "mismatch/is_weight_min": -neg_min if tokens else 1.0,
            "mismatch/is_weight_max": weight_max if tokens else 1.0,
            "mismatch/capped_fraction": capped / n,
        }


def _shifted(mask: torch.Tensor) -> torch.Tensor:
    """The tokens a mask of predicting positions predicts (one to the right)."""
    return torch.nn.functional.pad(mask[:-1], (1, 0), value=False)


# --- the objective state in checkpoints ------------------------------------------------------------

STATE_FORMAT = 1  # of the dict ``GRPOObjective.state_dict`` returns; checkpoints saved before it have no header
STATE_HEADER = {"objective": "grpo", "format": STATE_FORMAT}
STATE_KEYS = ("positions", "completions", "old_logps", "advantages", "stats")
# rl.importance_correction: tis; multi-turn episodes (their masks, and their prompts as rendered with tools)
OPTIONAL_KEYS = ("is_weights", "policy_masks", "prompt_ids")
STATE_FIX = "Resume from an earlier checkpoint (checkpoint.resume=auto skips damaged ones), or restore the file."


def _damaged(where: str | Path, what: str) -> UserError:
    return UserError(Problem(str(where), f"is damaged: {what}", STATE_FIX))


def _span(positions) -> str:
    """``8..15`` for a run of positions, else the first few and how many."""
    q = sorted(int(p) for p in positions)
    if not q:
        return "none"
    if q == list(range(q[0], q[0] + len(q))):
        return f"{q[0]}..{q[-1]}"
    return ", ".join(map(str, q[:6])) + (f", ... ({len(q)} positions)" if len(q) > 6 else "")


def kept_positions(samples: int, global_batch: int, iterations: int) -> range:
    """The positions of the prompt items that the step ending at sample position ``samples`` trained
    on (``llmft.data.sampler.RepeatedSteps``: each global batch taken ``iterations`` steps in a row)."""
    block, offset = divmod(max(samples - global_batch, 0), global_batch * iterations)
    first = block * global_batch + offset % global_batch
    return range(first, first + global_batch)


def _recipe_int(recipe: dict[str, Any], section: str, key: str, step_dir: Path) -> int:
    value = (recipe.get(section) or {}).get(key, getattr(getattr(Recipe(), section), key))
    if isinstance(value, bool) or not isinstance(value, int):
        raise _damaged(Path(step_dir) / "recipe.yaml", f"{section}.{key} is {value!r}, not a whole number")
    return value


def _vocab_size(model: torch.nn.Module) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        return None


def _is_tensor(value: Any, dims: int, kinds: tuple[torch.dtype, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == dims and value.dtype in kinds


def _equal(value: Any, expected: str | int) -> bool:
    """A header field is ``expected`` itself (a tensor or a list where it stood compares as no value)."""
    return type(value) is type(expected) and value == expected


def check_state(state: Any, where: str | Path, vocab: int | None = None) -> int:
    """The number of completions in one rank's saved kept batch, after checking that it is one: the
    header (``objective``, ``format``; none in older checkpoints), exactly ``STATE_KEYS``, and per
    completion a position (distinct, >= 0), token ids (>= 0, < ``vocab`` when given), as many finite
    old log-probs, and a finite advantage. A ``UserError`` naming ``where`` otherwise."""
    if not isinstance(state, dict):
        raise _damaged(where, f"holds a {type(state).__name__}, not a GRPO objective state")
    names = sorted(str(k) for k in state)
    if any(k in state for k in STATE_HEADER):
        got = {k: state.get(k) for k in STATE_HEADER}
        if not _equal(got["objective"], STATE_HEADER["objective"]):
            raise _damaged(where, f"is the objective state of {str(got['objective'])[:40]!r}, not of grpo")
        if not _equal(got["format"], STATE_FORMAT):
            raise _damaged(
                where,
                f"is format {str(got['format'])[:20]} of the GRPO objective state; this llmft reads {STATE_FORMAT}",
            )
    if not set(STATE_KEYS) <= set(state) - set(STATE_HEADER) <= set(STATE_KEYS) | set(OPTIONAL_KEYS):
        shown = ", ".join(names)[:200]
        raise _damaged(
            where, f"not a GRPO objective state (its keys are {shown}; a GRPO state has {', '.join(STATE_KEYS)})"
        )
    positions, completions, old, adv, stats = (state[k] for k in STATE_KEYS)
    if not _is_tensor(positions, 1, (torch.int64,)) or positions.numel() == 0:
        raise _damaged(where, "its positions are not a non-empty 1-D int64 tensor")
    n = positions.numel()
    if int(positions.min()) < 0 or positions.unique().numel() != n:
        raise _damaged(where, "its positions are not distinct positions >= 0")
    if not (isinstance(completions, list) and isinstance(old, list) and len(completions) == len(old) == n):
        raise _damaged(where, f"does not hold {n} completions and {n} lists of old log-probs for its {n} positions")
    if not _is_tensor(adv, 1, (torch.float32, torch.float64)) or adv.numel() != n or not bool(adv.isfinite().all()):
        raise _damaged(where, f"its advantages are not {n} finite numbers")
    masks = state.get("policy_masks")
    if masks is not None and (not isinstance(masks, list) or len(masks) != n):
        raise _damaged(where, f"does not hold {n} policy masks for its {n} positions")
    trained = []  # per completion, its policy tokens: what old log-probs and importance weights are of
    for j, (ids, logps) in enumerate(zip(completions, old, strict=True)):
        if not _is_tensor(ids, 1, (torch.int64,)) or (ids.numel() and int(ids.min()) < 0):
            raise _damaged(where, f"completion {j} is not a 1-D tensor of token ids")
        if vocab is not None and ids.numel() and int(ids.max()) >= vocab:
            raise _damaged(where, f"completion {j} holds token id {int(ids.max())}, beyond this model's {vocab}")
        policy = ids.numel()
        if masks is not None:
            if not _is_tensor(masks[j], 1, (torch.bool,)) or masks[j].numel() != ids.numel():
                raise _damaged(where, f"the policy mask of completion {j} is not {ids.numel()} booleans, one per token")
            policy = int(masks[j].sum())
        trained.append(policy)
        if not _is_tensor(logps, 1, (torch.float32, torch.float64)) or logps.numel() != policy:
            raise _damaged(where, f"the old log-probs of completion {j} are not {policy} numbers, one per policy token")
        if not bool(logps.isfinite().all()):
            raise _damaged(where, f"the old log-probs of completion {j} are not all finite")
    prompt_ids = state.get("prompt_ids")
    if prompt_ids is not None:
        if not isinstance(prompt_ids, list) or len(prompt_ids) != n:
            raise _damaged(where, f"does not hold {n} prompts for its {n} positions")
        for j, ids in enumerate(prompt_ids):
            if not _is_tensor(ids, 1, (torch.int64,)) or ids.numel() == 0 or int(ids.min()) < 0:
                raise _damaged(where, f"the prompt of completion {j} is not a non-empty 1-D tensor of token ids")
            if vocab is not None and int(ids.max()) >= vocab:
                raise _damaged(
                    where, f"the prompt of completion {j} holds token id {int(ids.max())}, beyond this model's {vocab}"
                )
    weights = state.get("is_weights")
    if weights is not None:
        if not isinstance(weights, list) or len(weights) != n:
            raise _damaged(where, f"does not hold {n} lists of importance weights for its {n} positions")
        for j, (policy, w) in enumerate(zip(trained, weights, strict=True)):
            if not _is_tensor(w, 1, (torch.float32, torch.float64)) or w.numel() != policy:
                raise _damaged(where, f"the importance weights of completion {j} are not {policy} numbers")
            if not bool(w.isfinite().all()) or bool((w < 0).any()):
                raise _damaged(where, f"the importance weights of completion {j} are not all finite and >= 0")
    if not isinstance(stats, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in stats.items()
    ):
        raise _damaged(where, "its stats are not a mapping of metric names to numbers")
    return n


DRAWN_KEYS = ("drawn_positions", "drawn_completions", "drawn_sampler")  # rollout.async's state


def check_drawn_state(state: Any, where: str | Path, vocab: int | None = None) -> int:
    """The number of completions in one rank's ``rollout.async`` state (``GRPOObjective._async_state``),
    after checking that it is one; a ``UserError`` naming ``where`` otherwise."""
    if not isinstance(state, dict) or not _equal(state.get("objective"), STATE_HEADER["objective"]):
        raise _damaged(where, "is not a GRPO objective state")
    if not _equal(state.get("format"), STATE_FORMAT) or set(state) - set(STATE_HEADER) != set(DRAWN_KEYS):
        keys = ", ".join(sorted(str(k) for k in state))[:200]
        raise _damaged(where, f"not the state of a rollout.async run (its keys are {keys})")
    positions, completions, sampler = (state[k] for k in DRAWN_KEYS)
    if not _is_tensor(positions, 1, (torch.int64,)):
        raise _damaged(where, "its drawn positions are not a 1-D int64 tensor")
    n = positions.numel()
    if n and (int(positions.min()) < 0 or positions.unique().numel() != n):
        raise _damaged(where, "its drawn positions are not distinct positions >= 0")
    if not (isinstance(completions, list) and isinstance(sampler, list) and len(completions) == len(sampler) == n):
        raise _damaged(where, f"does not hold {n} drawn completions and their sampler log-probs")
    for j, (ids, logps) in enumerate(zip(completions, sampler, strict=True)):
        if not _is_tensor(ids, 1, (torch.int64,)) or (ids.numel() and int(ids.min()) < 0):
            raise _damaged(where, f"drawn completion {j} is not a 1-D tensor of token ids")
        if vocab is not None and ids.numel() and int(ids.max()) >= vocab:
            raise _damaged(where, f"drawn completion {j} holds token id {int(ids.max())}, beyond this model's {vocab}")
        if not _is_tensor(logps, 1, (torch.float32,)) or logps.numel() not in (0, ids.numel()):
            raise _damaged(where, f"the sampler log-probs of drawn completion {j} are not one per token")
        if not bool(logps.isfinite().all()):
            raise _damaged(where, f"the sampler log-probs of drawn completion {j} are not all finite")
    return n


def _prompts(micro_batches: list[dict[str, Any]]) -> list[Prompt]:
    """The step's items (prompt ids, record, rollout position), in the micro-batches' order."""
    return [
        Prompt(ids, record, int(q))
        for mb in micro_batches
        for ids, record, q in zip(mb["prompt_ids"], mb["records"], mb["positions"].tolist(), strict=True)
    ]


@dataclass
class Kept:
    """One completion of a generation batch a checkpoint kept (``rl.iterations`` > 1), by position."""

    ids: list[int]
    advantage: float
    old_logps: torch.Tensor
    is_weights: torch.Tensor | None  # None: saved without rl.importance_correction
    policy: list[bool] | None  # a live episode's policy mask (None: every completion token is the policy's)
    prompt_ids: list[int] | None  # a live episode's rendered prompt


def _as_rendered(
    prompts: list[Prompt], completions: list[list[int]], restored: list[list[int] | None] | None
) -> list[Prompt]:
    """The step's items with each live episode's prompt as it was rendered (its tools, its
    environment's first words: ``Episode.prompt_ids``; ``restored``: as a checkpoint kept them)."""
    given = restored or [c.prompt_ids if isinstance(c, Episode) else None for c in completions]
    return [
        p if ids is None else Prompt(torch.tensor(ids, dtype=torch.long), p.record, p.position)
        for p, ids in zip(prompts, given, strict=True)
    ]


class GRPOObjective(ObjectiveBase):
    """Group-relative policy optimisation over completions of the global batch (module docstring)."""

    def __init__(self, plan: RunPlan, models: Models) -> None:
        super().__init__(plan, models)
        r = plan.recipe
        self.rl, self.cfg, self.G = r.rl, r.rollout, r.rollout.num_generations
        self.correction = importance_correction(r) == "tis"  # the sampler's log-probs, the weights, mismatch/*
        self.global_batch = plan.batch.global_batch_size
        self.policy = models.unwrap()
        self.models = models
        self.reference_kind = plan.reference
        self.reference = frozen_reference(plan, models)
        disable_dropout(self.policy)
        if self.reference is not None:
            disable_dropout(self.reference)
        self.synced = plan.layout.shards_params and plan.layout.dp_size > 1
        self.layout = plan.layout
        self.autocast = getattr(models, "autocast", contextlib.nullcontext)
        # rl.iterations > 1: (the step's positions, -1, its micro-batch sizes) and its update batches
        self._kept: tuple[tuple[int, ...], list[dict[str, Any]]] | None = None
        self._restored: dict[int, Kept] = {}  # from a checkpoint, by position
        self._restored_stats: dict[str, float] = {}
        self._stats: dict[str, float] = {}
        self._update_from = time.perf_counter()
        # rollout.async: the next step's micro-batches, their drawing, this step's drawn completions,
        # and what a checkpoint kept of them (position -> (completion, sampler log-probs))
        self.async_rollout = getattr(r.rollout, "async") == 1
        self.looks_ahead = self.async_rollout
        self._ahead: list[dict[str, Any]] | None = None
        self._pending: Any = None
        self._current: tuple[tuple[int, ...], list[list[int]], list[list[float]] | None] | None = None
        self._async_restored: dict[int, tuple[list[int], list[float]]] = {}
        self.rollout: Any = None
        self.rewards: Rewards | None = None

    def setup(self, context: ObjectiveSetup) -> None:
        self.tokenizer, self.env = context.tokenizer, context.env
        self.dp_rank = self.layout.dp_rank(context.env.rank)
        device = context.env.device
        self.rollout = make_rollout(self.plan.recipe, self.tokenizer, self.policy, device, self.synced, self.autocast)
        if self.cfg.tools or self.cfg.environment:  # multi-turn episodes over the backend's generator
            self.rollout = AgentRollout(self.plan.recipe, self.rollout, self.tokenizer, device)
        self.rewards = Rewards(
            list(self.plan.recipe.rewards),
            device,
            self.tokenizer,
            self.plan.recipe.model.hub_kernels,
            place=self.models.place_frozen,  # the engine's frozen-model door
            workers=self.plan.recipe.rl.reward_workers,
            environments=tuple(getattr(self.rollout, "reward_columns", ())),
        )
        self.metric_names = self.plan.objective_spec.metrics

    def close(self) -> None:
        if self._pending is not None:  # the drawing ends before its engine does
            with contextlib.suppress(Exception):
                self._pending.future.result()
            self._pending = None
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()
        if self.rewards is not None:
            self.rewards.close()  # its worker processes

    # --- the step's data stage -------------------------------------------------------------------

    def prepare(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        positions = tuple(int(q) for mb in micro_batches for q in mb["positions"].tolist())
        # the micro-batch sizes too: the same positions dealt otherwise (llmft verify's big batch) are
        # prepared again
        key = (*positions, -1, *(len(mb["positions"]) for mb in micro_batches))
        if self._kept is not None and self._kept[0] == key:  # the same generation batch again
            self._stats = {**self._stats, "generation_s": 0.0}
            return self._kept[1]
        prompts = _prompts(micro_batches)
        generation = positions[0] // self.global_batch  # the generation batch (rl.iterations steps share one)
        was_training = self.policy.training
        self.policy.eval()
        restored = self._restored_rollout(positions)
        sampler: list[list[float]] | None = None
        weights: list[torch.Tensor] | None = None
        if restored is not None:  # a resume inside a generation batch: its completions, old log-probs, weights
            completions = [k.ids for k in restored]
            adv, old = torch.tensor([k.advantage for k in restored]), [k.old_logps for k in restored]
            weights = [k.is_weights for k in restored] if self.correction else None  # type: ignore[misc]
            policy = [k.policy for k in restored]
        else:
            watchdog.phase(f"generating the completions of generation batch {generation}")
            t0 = time.perf_counter()
            drawn = self._drawn(positions) if self.async_rollout else None
            if drawn is not None:  # drawn during the last update (rollout.async), from the weights before it
                completions, sampler = drawn
            elif self.correction:
                completions, sampler = self.rollout.complete_scored(prompts, generation, self.dp_rank)
            else:
                completions = self.rollout.complete(prompts, generation, self.dp_rank)
            if self.async_rollout:
                self._current = (positions, completions, sampler)
                self._draw_ahead()  # the next step's, drawn while this one updates
            adv, old = self._advantages(prompts, completions, time.perf_counter() - t0), None
            if self.cfg.backend == "vllm":  # of generation_s: the trainer's weights into the engine
                self._stats["sync_s"] = self.rollout.sync_s
            if self.async_rollout:
                self._stats["rollout_staleness"] = 1.0 if drawn is not None else 0.0
            if self.cfg.save_completions:
                self._save_completions(generation, prompts, completions, sampler)
            policy = [c.policy if isinstance(c, Episode) else None for c in completions]
        prompts = _as_rendered(prompts, completions, [k.prompt_ids for k in restored] if restored is not None else None)
        watchdog.phase("old and reference log-probs")
        out, start = [], 0
        mismatch = Mismatch()
        for n in (len(mb["positions"]) for mb in micro_batches):
            batch = self._update_batch(
                prompts[start : start + n],
                completions[start : start + n],
                adv[start : start + n],
                policy[start : start + n],
            )
            self._frozen_logps(batch, old[start : start + n] if old is not None else None)
            if self.correction:
                if weights is not None:
                    _place(batch, "is_weights", weights[start : start + n])
                else:
                    assert sampler is not None
                    _place(batch, "is_weights", mismatch.weights(batch, sampler[start : start + n], self.rl.is_cap))
            out.append(batch)
            start += n
        if self.correction and restored is None:
            self._stats.update(mismatch.metrics(self.env.device))
        self.policy.train(was_training)
        if self.rl.iterations > 1:
            self._kept = (key, out)
        self._update_from = time.perf_counter()  # the update: from here to the step's metrics
        return out

    # --- rollout.async: the next step's completions drawn while this one updates ---------------------

    def look_ahead(self, micro_batches: list[dict[str, Any]]) -> None:
        """The next step's micro-batches, before this step's ``prepare`` (the loop fetches them early)."""
        self._ahead = micro_batches

    def _draw_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is None:  # the run's last step
            return
        prompts = _prompts(ahead)
        self._pending = self.rollout.start(prompts, prompts[0].position // self.global_batch, self.dp_rank)

    def _drawn(self, positions: tuple[int, ...]) -> tuple[list[list[int]], list[list[float]] | None] | None:
        """The completions of ``positions`` drawn ahead: by the drawing under way, or kept by the
        checkpoint resumed from; None: none were (the run's first step)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            completions, sampler = pending.result()
            if pending.positions == positions:
                return completions, sampler if self.correction else None
        saved = self._async_restored
        self._async_restored = {}
        if saved and all(q in saved for q in positions):
            completions = [saved[q][0] for q in positions]
            sampler = [saved[q][1] for q in positions] if self.correction else None
            return completions, sampler
        return None

    def _async_state(self) -> dict[str, Any]:
        """The step's drawn completions and the next step's (the drawing joined): a resume, also of a
        step abandoned by a stop, trains on the completions the run would have."""
        rows: dict[int, tuple[list[int], list[float] | None]] = {}
        if self._current is not None:
            positions, completions, sampler = self._current
            for j, q in enumerate(positions):
                rows[q] = (completions[j], sampler[j] if sampler is not None else None)
        if self._pending is not None:
            completions, sampler = self._pending.result()
            for j, q in enumerate(self._pending.positions):
                rows[q] = (completions[j], sampler[j])
        order = sorted(rows)
        return {
            **STATE_HEADER,
            "drawn_positions": torch.tensor(order, dtype=torch.long),
            "drawn_completions": [torch.tensor(rows[q][0], dtype=torch.long) for q in order],
            "drawn_sampler": [
                torch.tensor(rows[q][1] if rows[q][1] is not None else [], dtype=torch.float32) for q in order
            ],
        }

    def _save_completions(
        self, generation: int, prompts: list[Prompt], completions: list[list[int]], sampler: list[list[float]] | None
    ) -> None:
        """``rollout.save_completions``: this rank's completions of the generation batch, a line each."""
        out = Path(self.plan.recipe.run.output_dir) / COMPLETIONS_DIR
        out.mkdir(parents=True, exist_ok=True)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        with open(out / f"rank-{self.env.rank}.jsonl", "a", encoding="utf-8") as f:
            for i, (p, ids, text) in enumerate(zip(prompts, completions, texts, strict=True)):
                line = {"generation": generation, "position": p.position, "prompt": p.record["prompt"]}
                line.update(completion=text, completion_ids=[int(t) for t in ids])
                if sampler is not None:
                    line["sampler_logprobs"] = sampler[i]
                if isinstance(ids, Episode):  # the episode: its messages, which tokens the policy wrote, its prompt
                    line.update(messages=ids.messages, policy_mask=[int(m) for m in ids.policy])
                    if ids.prompt_ids is not None:
                        line["prompt_ids"] = ids.prompt_ids
                f.write(json.dumps(line, ensure_ascii=False) + "\n")

    # --- the kept generation batch in checkpoints (rl.iterations > 1) --------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        """The kept generation batch, per completion: a resume inside it (another world size too)
        trains on the same completions with the same old log-probs. With ``rollout.async``: the
        completions drawn ahead (``_async_state``)."""
        if self.async_rollout:
            return self._async_state()
        if self._kept is None:
            return None
        key, batches = self._kept
        positions = key[: key.index(-1)]
        completions, old, adv, weights, masks, prompt_ids = [], [], [], [], [], []
        for batch in batches:
            for i, mine in enumerate(_completion_tokens(batch)):
                sequence = batch["input_ids"][0][batch["sequence_index"][0] == i]
                if "context" in batch:  # an episode's tokens: its policy's and the context between them
                    tokens = _shifted(mine) | (batch["context"][0] & (batch["sequence_index"][0] == i))
                    completions.append(batch["input_ids"][0][tokens].clone())
                    masks.append(_shifted(mine)[tokens].clone())
                else:
                    completions.append(batch["labels"][0][_shifted(mine)].clone())
                    masks.append(torch.ones(int(mine.sum()), dtype=torch.bool))
                prompt_ids.append(sequence[: len(sequence) - len(completions[-1])].clone())
                old.append(batch["old_logps"][0][mine].clone())
                if "is_weights" in batch:
                    weights.append(batch["is_weights"][0][mine].clone())
            adv.append(batch["advantages"])
        return {
            **STATE_HEADER,
            "positions": torch.tensor(positions, dtype=torch.long),
            "completions": completions,
            "old_logps": old,
            "advantages": torch.cat(adv),
            "stats": dict(self._stats),
            **({"is_weights": weights} if weights else {}),
            **({"policy_masks": masks, "prompt_ids": prompt_ids} if any("context" in b for b in batches) else {}),
        }

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Every rank's kept batch (``llmft.checkpoint.manager.SavedState``: each names its file),
        checked before anything of it is used: a wrong one is a ``UserError`` naming the file."""
        self._restored = {}
        if self.async_rollout:
            self._async_restored = {}
            vocab = _vocab_size(self.policy)
            for i, state in enumerate(states):
                path = str(getattr(state, "path", f"objective state {i} of the checkpoint"))
                check_drawn_state(state, path, vocab)
                for j, q in enumerate(state["drawn_positions"].tolist()):
                    sampler = state["drawn_sampler"][j]
                    self._async_restored[q] = (state["drawn_completions"][j].tolist(), sampler.tolist())
            return
        if self.rl.iterations <= 1:  # nothing is kept across steps
            return
        vocab = _vocab_size(self.policy)
        where: dict[int, str] = {}
        for i, state in enumerate(states):
            path = str(getattr(state, "path", f"objective state {i} of the checkpoint"))
            check_state(state, path, vocab)
            for j, q in enumerate(state["positions"].tolist()):
                if q in where:
                    raise _damaged(path, f"holds position {q} of the kept generation batch, which {where[q]} holds too")
                where[q] = path
                self._restored[q] = Kept(
                    state["completions"][j].tolist(),
                    float(state["advantages"][j]),
                    state["old_logps"][j].float(),
                    state["is_weights"][j].float() if "is_weights" in state else None,
                    state["policy_masks"][j].tolist() if "policy_masks" in state else None,
                    state["prompt_ids"][j].tolist() if "prompt_ids" in state else None,
                )
            self._restored_stats = {k: float(v) for k, v in state["stats"].items()}

    def _restored_rollout(self, positions: tuple[int, ...]) -> list[Kept] | None:
        """The kept completions of ``positions`` when a checkpoint inside their generation batch
        holds them (each once: the next step generates afresh), else None."""
        if not self._restored:
            return None
        found = [q in self._restored for q in positions]
        if not any(found):  # a checkpoint on a generation boundary: its kept batch is done with
            self._restored = {}
            return None
        if not all(found):  # the checkpoint's check makes this unreachable; never train on half of it
            raise _damaged(
                "the checkpoint's objective/ state",
                f"holds {sum(found)} of the {len(positions)} completions of this step (positions {_span(positions)})",
            )
        saved = [self._restored[q] for q in positions]
        self._stats = {**self._restored_stats, "generation_s": 0.0}
        self._restored = {}
        if self.correction and any(k.is_weights is None for k in saved):
            raise _damaged(
                "the checkpoint's objective/ state",
                "holds no importance weights, but rl.importance_correction is tis (the checkpoint was saved without it)",
            )
        return saved

    @classmethod
    def check_saved_states(
        cls,
        states: list[tuple[Path, Any]],
        step_dir: Path,
        step: int,
        samples: int,
        global_batch: int | None,
        recipe: dict[str, Any],
    ) -> None:
        """``llmft.checkpoint.verify``: the objective states of a checkpoint (``states``: each file and
        what ``weights_only`` loaded from it) are the kept generation batch of its last step, whole,
        once; a checkpoint inside a generation batch holds one. ``recipe``: its saved recipe."""
        iterations = _recipe_int(recipe, "rl", "iterations", step_dir)
        if iterations <= 1:
            return  # nothing is kept (and nothing is read back: ``load_state_dict``)
        if global_batch is None:
            raise _damaged(
                Path(step_dir) / STATE_FILE, "has no batch, so where its step sits in a generation batch cannot be told"
            )
        kept = kept_positions(samples, global_batch, iterations)
        if not states:
            if samples % (global_batch * iterations):
                raise _damaged(
                    Path(step_dir) / OBJECTIVE_DIR,
                    f"holds no objective state, but step {step} sits inside a generation batch (rl.iterations "
                    f"{iterations}): a resume there needs the completions and old log-probs it kept",
                )
            return
        where: dict[int, Path] = {}
        for path, state in states:
            check_state(state, path)
            positions = state["positions"].tolist()
            for q in positions:
                if q in where:
                    raise _damaged(
                        path,
                        f"holds the kept generation batch of positions {_span(positions)}, which "
                        f"{where[q].relative_to(step_dir)} holds too",
                    )
                if q not in kept:
                    raise _damaged(
                        path,
                        f"holds the kept generation batch of positions {_span(positions)}, but "
                        f"step {step} trained on positions {_span(kept)} (a file of another step or run)",
                    )
                where[q] = path
        if len(where) != len(kept):
            named = states[0][0] if len(states) == 1 else Path(step_dir) / OBJECTIVE_DIR
            raise _damaged(
                named,
                f"holds the kept generation batch of positions {_span(sorted(where))}, but step "
                f"{step} trained on positions {_span(kept)} (a rank's file is missing, or of another run)",
            )

    def _advantages(self, prompts: list[Prompt], completions: list[list[int]], generation_s: float) -> torch.Tensor:
        """This rank's completions' advantages, from every rank's rewards (one all-gather)."""
        assert self.rewards is not None
        scores = self._score(prompts, completions)
        total = self.rewards.total(scores)
        eos = self.tokenizer.eos_token_id
        lengths = torch.tensor(  # an episode's: the tokens its policy wrote
            [sum(c.policy) if isinstance(c, Episode) else len(c) for c in completions], dtype=torch.float64
        )
        ended = torch.tensor([float(bool(c) and c[-1] == eos) for c in completions], dtype=torch.float64)
        mine = torch.stack(
            [torch.tensor([p.position for p in prompts], dtype=torch.float64), total, lengths, ended], dim=1
        )
        timing = torch.full((len(prompts), 1), generation_s, dtype=torch.float64)
        turns = torch.tensor(  # NaN for a single completion: the step's means are over its episodes
            [
                [c.turns, c.tool_calls, c.tool_failures, c.parse_failures] if isinstance(c, Episode) else [math.nan] * 4
                for c in completions
            ],
            dtype=torch.float64,
        )
        rows = all_gather_rows(torch.cat([mine, timing, turns, scores], dim=1).to(self.env.device)).cpu()
        order = rows[:, 0].argsort()
        rows = rows[order]
        everyone = advantages(rows[:, 1], self.G, self.rl.scale_rewards)
        where = {int(q): i for i, q in enumerate(rows[:, 0].tolist())}
        self._stats = self._rollout_stats(rows)
        self._stats.update(self.rewards.event_metrics(self.env.device))  # reward_timeouts/..., every rank's
        return everyone[[where[p.position] for p in prompts]]

    def _score(self, prompts: list[Prompt], completions: list[list[int]]) -> torch.Tensor:
        """The rewards of ``completions`` (``Rewards.score``): their text, or a multi-turn episode's last
        assistant message's text and the episode (``completion_messages``)."""
        assert self.rewards is not None
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        texts = [
            c.text if isinstance(c, Episode) and c.messages else t for c, t in zip(completions, texts, strict=True)
        ]
        messages = [c.messages if isinstance(c, Episode) and c.messages else None for c in completions]
        given = [c.rewards if isinstance(c, Episode) else {} for c in completions]
        return self.rewards.score(
            [p.record["prompt"] for p in prompts], texts, [p.record for p in prompts], messages, given
        )

    def _rollout_stats(self, rows: torch.Tensor) -> dict[str, float]:
        total, lengths, ended, gen_s, scores = rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4], rows[:, 9:]
        turns, calls, failures, unparsed = rows[:, 5], rows[:, 6], rows[:, 7], rows[:, 8]
        by_group = total.view(-1, self.G)
        stats = {
            "reward": float(total.mean()),
            "reward_std": float(total.std()) if total.numel() > 1 else 0.0,
            "reward_group_std": float(by_group.std(dim=1).mean()) if self.G > 1 else 0.0,
            "completion_length": float(lengths.mean()),
            "completion_length_max": float(lengths.max()),
            "truncated_fraction": float(1.0 - ended.mean()),
            "generation_s": float(gen_s.max()),
            "generation_tokens_per_s": float(lengths.sum() / max(float(gen_s.max()), 1e-9)),
        }
        episodes = ~turns.isnan()
        if bool(episodes.any()):  # multi-turn episodes: assistant messages and tool calls per episode
            stats["turns"] = float(turns[episodes].mean())
            stats["tool_calls"] = float(calls[episodes].mean())
            stats["tool_failures"] = float(failures[episodes].mean())  # calls that raised or named no tool
            stats["tool_parse_failures"] = float(unparsed[episodes].mean())  # turns whose call did not parse
        assert self.rewards is not None
        for j, name in enumerate(self.rewards.names):
            column = scores[:, j]
            known = column[~column.isnan()]
            stats[f"rewards/{name}"] = float(known.mean()) if known.numel() else math.nan
        return stats

    def _update_batch(
        self,
        prompts: list[Prompt],
        completions: list[list[int]],
        adv: torch.Tensor,
        policy: list[list[bool] | None] | None = None,
    ) -> dict[str, Any]:
        """One packed row of prompt + completion sequences (module docstring, item 3). ``policy``: per
        completion, which of its tokens the policy wrote (a multi-turn episode's; None: all of them):
        the others are context, labelled ``IGNORE_INDEX`` (out of the loss and the count) and marked
        in ``context``, which the batch holds only when some completion has any."""
        ids, labels, positions, index, context = [], [], [], [], []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            seq = torch.cat([p.ids.long(), torch.tensor(c, dtype=torch.long)])
            ids.append(seq)
            target = seq[len(p.ids) :].clone()
            mask = policy[i] if policy is not None else None
            outside = torch.zeros(len(seq), dtype=torch.bool)
            if mask is not None:
                assert len(mask) == len(c), (len(mask), len(c))
                mine = torch.tensor(mask, dtype=torch.bool)
                target[~mine] = IGNORE_INDEX
                outside[len(p.ids) :] = ~mine
            context.append(outside)
            labels.append(torch.cat([torch.full((len(p.ids),), IGNORE_INDEX, dtype=torch.long), target]))
            positions.append(torch.arange(len(seq)))
            index.append(torch.full((len(seq),), i, dtype=torch.long))
        batch: dict[str, Any] = {
            "input_ids": torch.cat(ids)[None],
            "labels": torch.cat(labels)[None],
            "position_ids": torch.cat(positions)[None],
            "sequence_index": torch.cat(index)[None],
            "advantages": adv.float(),
            "num_completions": len(prompts),
        }
        _, valid = predicted_targets(batch["labels"], batch["sequence_index"])
        lengths = torch.zeros(len(prompts)).index_add(0, batch["sequence_index"][valid], torch.ones(int(valid.sum())))
        batch["completion_lengths"] = lengths
        if policy is not None and any(m is not None for m in policy):
            batch["context"] = torch.cat(context)[None]
        return batch

    @torch.no_grad()
    def _frozen_logps(self, batch: dict[str, Any], old: list[torch.Tensor] | None) -> None:
        """The old policy's (``rl.iterations`` > 1; ``old`` per completion when restored) and the
        reference's (``rl.beta`` > 0) per-token log-probs."""
        device = self.env.device
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        temperature = self.cfg.temperature
        if self.rl.iterations > 1 and old is not None:
            _place(batch, "old_logps", old)
        elif self.rl.iterations > 1 or self.correction:  # the importance weights need the trainer's
            with self.autocast():
                batch["old_logps"] = token_logps(self.policy, on_device, temperature)[0].float().cpu()
        if self.rl.beta == 0 or self.reference_kind == NO_REFERENCE:
            return
        model, scope = self.reference, contextlib.nullcontext()
        if self.reference_kind == ADAPTERS_DISABLED:
            model, scope = self.policy, self.policy.disable_adapter()
        with scope, self.autocast():
            batch["reference_logps"] = token_logps(model, on_device, temperature)[0].float().cpu()

    # --- eval -------------------------------------------------------------------------------------

    def evaluate(self, dataset: Any, env: DistEnv, max_items: int | None) -> dict[str, float]:
        """The held-out reward: one greedy completion per eval prompt (``rollout.backend: file``: its
        first completion), scored by ``rewards``; means over every eval prompt of every rank."""
        assert self.rewards is not None
        if self._pending is not None:  # the engine is free before the eval generates with it
            self._pending.future.result()
        n = len(dataset) if max_items is None else min(len(dataset), max_items)
        mine, per = eval_shard(n, self.dp_rank, self.layout.dp_size)
        items = [dataset[i] for i in mine] or [dataset[0]]
        items += [items[0]] * (per - len(items))  # equal generate() calls on every rank
        prompts = [Prompt(torch.tensor(np.asarray(it["input_ids"]), dtype=torch.long), it["record"], 0) for it in items]
        was_training = self.policy.training
        self.policy.eval()
        completions = self.rollout.complete(prompts, -1, self.dp_rank, greedy=True)
        self.policy.train(was_training)
        scores = self._score(prompts, completions)
        real = len(mine)
        total = self.rewards.total(scores)[:real]
        known = ~scores[:real].isnan()
        columns = torch.nan_to_num(scores[:real], nan=0.0).sum(0).tolist()
        sums = all_reduce_sum(
            [
                float(total.sum()),
                float(real),
                float(sum(sum(c.policy) if isinstance(c, Episode) else len(c) for c in completions[:real])),
                *columns,
                *known.sum(0).tolist(),
            ],
            env.device,
        )
        total_sum, count, lengths = sums[:3]
        k = len(self.rewards.names)
        row = {
            "reward": total_sum / max(count, 1.0),
            "prompts": int(count),
            "completion_length": lengths / max(count, 1.0),
        }
        for j, name in enumerate(self.rewards.names):
            row[f"rewards/{name}"] = sums[3 + j] / max(sums[3 + k + j], 1.0)
        row.update(self.rewards.event_metrics(env.device))
        return row

    # --- the loss ----------------------------------------------------------------------------------

    def count(self, batch: dict[str, Any]) -> int:
        """Completion tokens (``global_token``), completions (``sequence``), or completions x
        ``rollout.max_new_tokens`` (``constant``)."""
        if self.rl.normalise == "global_token":
            return int(batch["completion_lengths"].sum())
        if self.rl.normalise == "sequence":
            return int(batch["num_completions"])
        return int(batch["num_completions"]) * self.cfg.max_new_tokens

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, valid = predicted_targets(batch["labels"], batch["sequence_index"])
        seq = torch.where(valid, batch["sequence_index"], 0)
        logps, entropy = token_logps(model, batch, self.cfg.temperature)
        logps = logps.float()
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        adv = batch["advantages"].to(logps.device)[seq]
        ratio = torch.exp(logps - old)
        low, high = (
            1.0 - self.rl.epsilon,
            1.0 + (self.rl.epsilon_high if self.rl.epsilon_high is not None else self.rl.epsilon),
        )
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        if "is_weights" in batch:  # rl.importance_correction: the policy term, not the KL (as TRL does)
            per_token = per_token * batch["is_weights"].to(per_token.device)
        kl = torch.zeros_like(logps)
        if "reference_logps" in batch:
            d = batch["reference_logps"] - logps
            kl = torch.exp(d) - d - 1.0
            # times the ratio (1 in value): the k3 estimate's gradient under the sampling policy, as
            # TRL's GRPOTrainer does by default (use_bias_correction_kl)
            per_token = per_token + self.rl.beta * kl * ratio
        weight = valid.float()
        if self.rl.normalise == "sequence":
            weight = weight / batch["completion_lengths"].to(weight.device)[seq].clamp_min(1.0)
        loss = (per_token * weight).sum() / num_items
        clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
        tokens = valid.float()
        sums = torch.stack(
            [
                (kl.detach() * tokens).sum(),
                (clipped.float() * tokens).sum(),
                (entropy * tokens).sum() if entropy is not None else torch.tensor(math.nan, device=tokens.device),
                tokens.sum(),
                torch.tensor(float(batch["num_completions"]), device=tokens.device),
            ]
        )
        return loss, sums.detach()

    def metrics(self, sums: list[float], count: float) -> dict[str, float]:
        kl, clipped, entropy, tokens, completions = sums
        update_s = time.perf_counter() - self._update_from
        out = {
            "update_s": update_s,
            "update_tokens_per_s": tokens / max(update_s, 1e-9),
            "kl": kl / max(tokens, 1.0),
            "clip_fraction": clipped / max(tokens, 1.0),
            **({"entropy": entropy / max(tokens, 1.0)} if math.isfinite(entropy) else {}),  # not with the chunked head
            "completion_tokens": tokens,
            "completions": completions,
        }
        return {**out, **self._stats}
