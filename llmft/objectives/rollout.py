"""Completions for online RL (``rollout.*``): a backend turns a step's prompts into token ids.

A backend answers ``complete(prompts)``: for each of this rank's items of the step (a prompt's ids,
its record and its rollout position ``q``; completion ``q % G`` of its prompt) the completion's token
ids, ending with eos unless ``rollout.max_new_tokens`` cut it. Two exist; a third (vLLM) would be
one more class with the same method:

- ``hf``: transformers ``generate()`` with its KV cache on the policy as the engine holds it. Where
  parameters are sharded (FSDP2, ZeRO-3) every rank joins every forward (``synced_gpus``), so ranks
  whose completions end at different lengths do not hang. Sampling is seeded from
  (``run.seed``, the generation batch, the data-parallel rank) in a forked RNG: the training RNG is
  untouched, and a resume regenerates the same samples without saving any generator state.
- ``file``: ``rollout.file``, a JSONL of ``{"prompt": ..., "completions": [G strings]}`` looked up by
  the record's prompt exactly as the data holds it (text, or messages). Tests and runs that train
  on samples generated elsewhere use it; the completions are the same whatever the split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmft.errors import Problem, UserError
from llmft.job import watchdog

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


@dataclass
class Prompt:
    """One item of the step: its prompt's token ids, its record, its rollout position."""

    ids: torch.Tensor  # [P] int64
    record: dict[str, Any]
    position: int  # q: the prompt is q // G of the step's order, the completion q % G


def prompt_key(prompt: Any) -> str:
    """How a prompt (text or messages) is looked up in ``rollout.file``."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def end_at_eos(ids: list[int], eos: set[int], limit: int) -> list[int]:
    """A completion up to and including its first eos, at most ``limit`` tokens."""
    for i, t in enumerate(ids[:limit]):
        if t in eos:
            return ids[: i + 1]
    return ids[:limit]


class FileRollout:
    """``rollout.backend: file``."""

    def __init__(self, recipe: Recipe, tokenizer: Any) -> None:
        cfg = recipe.rollout
        self.G, self.limit, self.tokenizer = cfg.num_generations, cfg.max_new_tokens, tokenizer
        self.table = read_rollout_file(cfg.file, self.G)

    def complete(self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False) -> list[list[int]]:
        out = []
        eos = self.tokenizer.eos_token_id
        for p in prompts:
            key = prompt_key(p.record["prompt"])
            texts = self.table.get(key)
            if texts is None:
                raise UserError(
                    Problem(
                        "rollout.file",
                        f"has no line for the prompt {key[:200]}",
                        'Add {"prompt": <the prompt as the data holds it>, "completions": [...]} for it, or use '
                        "rollout.backend=hf.",
                    )
                )
            ids = self.tokenizer(texts[p.position % self.G], add_special_tokens=False)["input_ids"]
            out.append(list(ids)[: self.limit] + ([eos] if len(ids) < self.limit else []))
        return out


def read_rollout_file(path: str | None, G: int) -> dict[str, list[str]]:
    """``rollout.file`` as prompt key -> G completions; every line checked (file:line errors)."""
    if not path:
        raise UserError(Problem("rollout.file", "is not set, but rollout.backend is file", "Name the JSONL file."))
    problems: list[Problem] = []
    table: dict[str, list[str]] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(
            Problem("rollout.file", f"cannot read {path} ({type(e).__name__}: {e})", "Check the path.")
        ) from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(Problem(where, f"is not JSON ({e.msg})", "Write one JSON object per line."))
            continue
        completions = value.get("completions") if isinstance(value, dict) else None
        if not isinstance(value, dict) or "prompt" not in value or not isinstance(completions, list):
            problems.append(
                Problem(where, "is not {prompt, completions}", 'Write {"prompt": ..., "completions": [...]}.')
            )
        elif len(completions) < G or not all(isinstance(c, str) for c in completions):
            problems.append(
                Problem(
                    where,
                    f"has {len(completions)} completions, not {G} strings",
                    f"Give rollout.num_generations={G} strings.",
                )
            )
        else:
            table[prompt_key(value["prompt"])] = completions
        if len(problems) >= 5:
            break
    if problems:
        raise UserError(*problems, title=f"rollout.file {path} is not usable")
    return table


class HFRollout:
    """``rollout.backend: hf``: sampling with transformers ``generate()`` on the policy."""

    def __init__(
        self, recipe: Recipe, tokenizer: Any, model: torch.nn.Module, device: torch.device, synced: bool, autocast
    ) -> None:
        cfg = recipe.rollout
        self.cfg, self.tokenizer, self.model, self.device = cfg, tokenizer, model, device
        self.synced, self.autocast, self.seed = synced, autocast, recipe.run.seed
        eos = tokenizer.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())

    @torch.no_grad()
    def complete(self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False) -> list[list[int]]:
        """Every rank calls this with the same number of prompts (the step's local batch, or an eval
        shard padded to equal): sharded engines join each generate() call together."""
        size = self.cfg.batch_size or len(prompts)
        out: list[list[int]] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(generation_seed(self.seed, generation, dp_rank))
            for start in range(0, math.ceil(len(prompts) / size) * size, size):
                watchdog.phase(
                    f"generating completions {start + 1}-{min(start + size, len(prompts))} of {len(prompts)}"
                )
                out += self._generate(prompts[start : start + size], greedy)
        return out

    def _generate(self, prompts: list[Prompt], greedy: bool) -> list[list[int]]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p.ids) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left-padded
            input_ids[row, width - len(p.ids) :] = p.ids
            mask[row, width - len(p.ids) :] = 1
        with self.autocast():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=self.cfg.max_new_tokens,
                **(
                    {"do_sample": False}
                    if greedy
                    else {"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": 0}
                ),
                pad_token_id=pad,
                eos_token_id=sorted(self.eos),
                synced_gpus=self.synced,
            )
        return [end_at_eos(row.tolist(), self.eos, self.cfg.max_new_tokens) for row in out[:, width:].cpu()]


def generation_seed(seed: int, generation: int, dp_rank: int) -> int:
    """The sampling seed of one rank's share of one generation batch (a pure function: resumes match)."""
    return (seed * 1_000_003 + generation * 7919 + dp_rank * 104_729 + 17) % (2**63 - 1)


def make_rollout(recipe: Recipe, tokenizer: Any, model: torch.nn.Module, device: torch.device, synced: bool, autocast):
    if recipe.rollout.backend == "file":
        return FileRollout(recipe, tokenizer)
    return HFRollout(recipe, tokenizer, model, device, synced, autocast)
