"""Generation: prompts' token ids in, completions' token ids out. The exact-match eval
(``llmft.training.evaluate``) and online RL's rollouts (``llmft.objectives.rollout``) both call it.

A backend is a ``Generator``, one method: ``generate(prompts, how)``; one that can also return the
sampler's log-prob of each token it drew (``rl.importance_correction: tis``) has ``sample(prompts,
how)`` -> (completions, log-probs) for ``how.logprobs``, as ``HFGenerator`` does. ``HFGenerator`` is
transformers' ``generate()`` with its KV cache, on the model as the engine holds it. Another
backend (vLLM) is one more class with the same method, and the rollout takes any of them. What
every backend keeps (``HFGenerator`` shows how):

- every rank calls ``generate`` with the same number of prompts, and where parameters are sharded
  (FSDP2, ZeRO-3) every rank joins every forward (``synced``: transformers' ``synced_gpus``), so a
  rank whose sequences ended keeps joining its peers' forwards and none waits forever;
- a stop request (``llmft.stop``) ends every sequence at its next token (``stop_criteria``), and
  after each ``generate()`` call of ``how.batch_size`` prompts every rank votes
  (``llmft.job.dist.cut_short``): if any rank was asked to stop, all raise ``stop.Abandoned(how.what)``
  together, and no cut completion is used;
- with ``how.seed`` the draws come from a forked RNG seeded with it: the caller's RNG is untouched,
  and the same seed draws the same completions (a resume regenerates them without saving any
  generator state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmft import stop
from llmft.job import watchdog
from llmft.job.dist import cut_short


@dataclass(frozen=True)
class Generation:
    """How one ``generate`` call draws its completions."""

    max_new_tokens: int
    greedy: bool = True  # False: sampled with temperature and top_p (no top-k)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # the draws' seed, in a forked RNG; None: no RNG of its own (greedy)
    batch_size: int | None = None  # prompts per generate() call; None: all at once
    what: str = "generation"  # what a stop cut short, in the stop's message ("its generation was cut short")
    phases: bool = False  # name each generate() call to the stall watchdog (an objective's data stage)
    # ``sample`` also returns each new token's log-prob under the sampler: log softmax(logits / temperature)
    # at the drawn token, the distribution the trainer's log-probs use (top_p does not renormalise it).
    logprobs: bool = False
    # A backend that samples from its own copy of the weights (vLLM) syncs the policy's into it before
    # a call with ``fresh`` (the policy may have changed) and gives its device memory back after one
    # with ``release``; a multi-turn rollout's later turns of one generation batch pass neither.
    fresh: bool = True
    release: bool = True
    # Token ids that end a completion: a backend that does not know the tokenizer (vLLM's engine is
    # built without one) stops there instead of drawing max_new_tokens past them.
    eos: tuple[int, ...] = ()


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The token ids that end a completion: the tokenizer's eos (one id, or several), sorted."""
    eos = tokenizer.eos_token_id
    return (eos,) if isinstance(eos, int) else tuple(sorted(eos or ()))


class Generator(Protocol):
    """A generation backend."""

    def generate(self, prompts: Sequence[Any], how: Generation) -> list[list[int]]:
        """Each prompt's completion ids, in order. ``prompts`` are 1-D token ids (tensors or
        arrays); a row may go on past its first eos (padding: ``rollout.end_at_eos`` cuts it).
        Every rank calls it with as many prompts, and it keeps the module docstring's rules."""
        ...


class HFGenerator:
    """transformers ``generate()`` on ``model``, left-padded, every rank in step."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_id: int | list[int] | None,
        device: torch.device,
        synced: bool,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.model, self.pad, self.eos, self.device = model, pad_token_id, eos_token_id, device
        self.synced, self.autocast = synced, autocast

    def generate(self, prompts: Sequence[Any], how: Generation) -> list[list[int]]:
        return self.sample(prompts, how)[0]

    @torch.no_grad()
    def sample(self, prompts: Sequence[Any], how: Generation) -> tuple[list[list[int]], list[list[float]]]:
        size = how.batch_size or max(len(prompts), 1)
        out: list[list[int]] = []
        logps: list[list[float]] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=how.seed is not None), stop.during(stop.GENERATING):
            if how.seed is not None:
                torch.manual_seed(how.seed)
            for start in range(0, len(prompts), size):
                if how.phases:
                    watchdog.phase(
                        f"generating completions {start + 1}-{min(start + size, len(prompts))} of {len(prompts)}"
                    )
                ids, scored = self._call(prompts[start : start + size], how)
                out += ids
                logps += scored
                cut_short(how.what, self.device)
        return out, logps

    def _call(self, prompts: Sequence[Any], how: Generation) -> tuple[list[list[int]], list[list[float]]]:
        """One ``generate()`` call: the new tokens of each row (padded after a row's eos) and, with
        ``how.logprobs``, their log-probs under the sampler (from the logits ``generate`` returns:
        it keeps every step's ``[rows, vocab]`` until it returns)."""
        input_ids, mask = left_pad(prompts, self.pad)
        if how.greedy:
            draw: dict[str, Any] = {"do_sample": False}
        else:
            draw = {"do_sample": True, "temperature": how.temperature, "top_p": how.top_p, "top_k": 0}
        with self.autocast():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=how.max_new_tokens,
                **draw,
                pad_token_id=self.pad,
                eos_token_id=self.eos,
                synced_gpus=self.synced,
                stopping_criteria=stop_criteria(),
                **({"output_logits": True, "return_dict_in_generate": True} if how.logprobs else {}),
            )
        if not how.logprobs:
            return out[:, input_ids.shape[1] :].cpu().tolist(), []
        new = out.sequences[:, input_ids.shape[1] :]
        temperature = 1.0 if how.greedy else how.temperature
        scored = torch.stack(
            [
                torch.log_softmax(step.float() / temperature, dim=-1).gather(-1, new[:, t : t + 1]).squeeze(-1)
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )
        return new.cpu().tolist(), scored.cpu().tolist()


def left_pad(prompts: Sequence[Any], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, ``[B, longest]`` int64: each prompt at the right end of its
    row (generation appends after the last column), filled from the prompt arrays, no list per token."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        if len(p):
            input_ids.numpy()[row, width - len(p) :] = p
            mask[row, width - len(p) :] = 1
    return input_ids, mask


def stop_criteria() -> list:
    """A ``generate()`` stopping criterion that ends every sequence once this process is asked to
    stop (``llmft.stop``). With ``synced_gpus`` a rank whose sequences ended keeps joining the
    forwards of ranks still generating, so a peer that got no signal finishes its own tokens and
    no rank waits forever."""
    from transformers import StoppingCriteria

    class _StopCriterion(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            asked = stop.requested() is not None
            return torch.full((input_ids.shape[0],), asked, dtype=torch.bool, device=input_ids.device)

    return [_StopCriterion()]
