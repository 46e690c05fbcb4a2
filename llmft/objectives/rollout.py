"""Completions for online RL (``rollout.*``): a backend turns a step's prompts into token ids.

A backend answers ``complete(prompts)``: for each of this rank's items of the step (a prompt's ids,
its record and its rollout position ``q``; completion ``q % G`` of its prompt) the completion's token
ids, ending with eos unless ``rollout.max_new_tokens`` cut it. Two exist:

- ``hf``: ``GeneratedRollout`` over ``llmft.model.generate.HFGenerator``, transformers ``generate()``
  with its KV cache on the policy as the engine holds it. Where parameters are sharded (FSDP2,
  ZeRO-3) every rank joins every forward (``synced_gpus``), so ranks whose completions end at
  different lengths do not hang. Sampling is seeded from (``run.seed``, the generation batch, the
  data-parallel rank) in a forked RNG: the training RNG is untouched, and a resume regenerates the
  same samples without saving any generator state. Another generating backend (vLLM) is one more
  ``Generator`` (``llmft.model.generate``) behind the same ``GeneratedRollout``.
- ``file``: ``rollout.file``, a JSONL of ``{"prompt": ..., "completions": [G strings]}`` (or
  ``"completion_ids": [G lists of token ids]``, trained as given: what ``rollout.save_completions``
  writes) looked up by the record's prompt exactly as the data holds it (text, or messages). Tests and runs that train
  on samples generated elsewhere use it; the completions are the same whatever the split. Each
  line is bounded as a data record is (``llmft.limits``), and a completion is cut to the character
  budget of ``rollout.max_new_tokens`` before it is tokenized (``encode.cut_ids``: the same ids).
  A completion may be a multi-turn episode, the messages after a prompt given as messages: its ids
  and policy mask come from the chat template (``llmft.objectives.episodes.Episode``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmft.data.encode import cut_ids, text_budget
from llmft.data.read import bounded_lines, not_utf8, parse_line, too_long
from llmft.errors import Problem, UserError
from llmft.model import vllm_backend  # vllm itself is imported only when a recipe asks for it
from llmft.model.generate import Generation, Generator, HFGenerator, eos_ids
from llmft.objectives.episodes import Episode, episode_ids, episode_problem

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

    def __init__(self, recipe: Recipe, tokenizer: Any, vocab: int | None = None) -> None:
        cfg = recipe.rollout
        self.G, self.limit, self.tokenizer, self.vocab = cfg.num_generations, cfg.max_new_tokens, tokenizer, vocab
        self.cfg_file = cfg.file
        self.lines: dict[str, int] = {}  # prompt key -> its line (a multi-turn episode's errors name it)
        self.table = read_rollout_file(cfg.file, self.G, self.lines)
        self.budget = text_budget(tokenizer, self.limit)  # characters of a completion the tokenizer sees

    def complete(self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False) -> list[list[int]]:
        texts = []
        for p in prompts:
            key = prompt_key(p.record["prompt"])
            texts_of = self.table.get(key)
            if texts_of is None:
                raise UserError(
                    Problem(
                        "rollout.file",
                        f"has no line for the prompt {key[:200]}",
                        'Add {"prompt": <the prompt as the data holds it>, "completions": [...]} for it, or use '
                        "rollout.backend=hf.",
                    )
                )
            texts.append(texts_of[p.position % self.G])
        out: list[list[int] | None] = [None] * len(texts)
        for i, given in enumerate(texts):  # a multi-turn episode: ids and policy mask by the chat template
            if isinstance(given, list) and given and isinstance(given[0], dict):
                out[i] = self._episode(prompts[i], given)
        for i, given in enumerate(texts):  # a line's completion_ids: as sampled, no eos added
            if isinstance(given, list) and out[i] is None:
                every = [*given, *(given.prompt_ids or () if isinstance(given, Episode) else ())]
                if self.vocab is not None and any(t >= self.vocab for t in every):
                    raise UserError(
                        Problem(
                            "rollout.file",
                            f"gives the prompt {prompt_key(prompts[i].record['prompt'])[:200]} token id "
                            f"{max(every)}, beyond the model's vocabulary ({self.vocab})",
                            "Give ids the policy's tokenizer made, for this model.",
                        )
                    )
                out[i] = given.cut(self.limit) if isinstance(given, Episode) else given[: self.limit]
        # Cut to the budget of max_new_tokens first: the first max_new_tokens ids are the whole
        # completion's, and a 50 MB completion is never tokenized whole.
        strings = [t for t in texts if isinstance(t, str)]
        ids_list, _ = cut_ids(self._ids, strings, self.limit, self.budget) if strings else ([], None)
        eos = self.tokenizer.eos_token_id
        made = iter([list(ids)[: self.limit] + ([eos] if len(ids) < self.limit else []) for ids in ids_list])
        return [row if row is not None else next(made) for row in out]

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _episode(self, prompt: Prompt, episode: list[dict[str, Any]]) -> Episode:
        key = prompt_key(prompt.record["prompt"])
        where = f"{self.cfg_file}:{self.lines.get(key, '?')}"
        try:
            return episode_ids(self.tokenizer, prompt.record["prompt"], episode, self.limit, self.budget)
        except ValueError as e:  # the template cannot tell the policy's tokens from its own
            raise UserError(
                Problem(
                    where,
                    f"a multi-turn episode cannot be tokenized: {e}",
                    "Use a chat template that renders every prefix of a conversation as its prefix "
                    "(data.chat_template: llmft, chatml or llama3 do), or give the episode as completion_ids.",
                )
            ) from e


def read_rollout_file(path: str | None, G: int, lines: dict[str, int] | None = None) -> dict[str, list]:
    """``rollout.file`` as prompt key -> G completions; every line checked (file:line errors).

    A line is UTF-8 JSON ``{"prompt": ..., "completions": [G strings]}`` of at most
    ``RECORD_MAX_BYTES`` bytes and ``RECORD_MAX_DEPTH`` levels, as a data record (``llmft.limits``);
    read a line at a time, a longer one is skipped without being held. Exactly G completions: with
    more, which G would be trained on is a guess. A prompt given twice with other completions is
    refused, naming both lines. A completion may be a multi-turn episode, the list of messages after
    a prompt given as messages (``llmft.objectives.episodes``). ``lines``: filled with each prompt
    key's line."""
    if not path:
        raise UserError(Problem("rollout.file", "is not set, but rollout.backend is file", "Name the JSONL file."))
    problems: list[Problem] = []
    table: dict[str, list[str]] = {}
    first: dict[str, int] = {}  # prompt key -> the line that gave it
    try:
        with open(path, "rb") as f:
            for n, raw, size in bounded_lines(f):
                problem = _rollout_line(f"{path}:{n}", raw, size, G, table, first, n)
                if problem is not None:
                    problems.append(problem)
                if len(problems) >= 5:
                    break
    except OSError as e:
        raise UserError(
            Problem("rollout.file", f"cannot read {path} ({type(e).__name__}: {e})", "Check the path.")
        ) from e
    if problems:
        raise UserError(*problems, title=f"rollout.file {path} is not usable")
    if lines is not None:
        lines.update(first)
    return table


def _rollout_line(
    where: str, raw: bytes | None, size: int, G: int, table: dict[str, list[str]], first: dict[str, int], n: int
) -> Problem | None:
    """One line of ``rollout.file`` into ``table``, or the problem with it."""
    shape = 'Write one JSON object per line: {"prompt": ..., "completions": [...]}.'
    if raw is None:
        return Problem(where, too_long(size, fix=""), "Shorten its completions: only the first rollout.max_new_tokens "
                       "tokens of each are trained on.")  # fmt: skip
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Problem(where, not_utf8(e), "Save the file as UTF-8 (JSON text is UTF-8).")
    if not line.strip():
        return None
    try:
        value = parse_line(line, None)  # the bounds of a data record: nesting, size
    except ValueError as e:
        return Problem(where, str(e), shape)
    if isinstance(value, dict) and "completion_ids" in value and "completions" not in value:
        return _ids_line(where, value, G, table, first, n)
    completions = value.get("completions") if isinstance(value, dict) else None
    if not isinstance(value, dict) or "prompt" not in value or not isinstance(completions, list):
        return Problem(where, "is not {prompt, completions}", 'Write {"prompt": ..., "completions": [...]}.')
    count = len(completions)
    if count > G:  # which G of them would be trained on is a guess
        return Problem(
            where,
            f"has {count} completions, more than rollout.num_generations={G}",
            f"Give exactly {G} completions per prompt (drop the extra ones), or set "
            f"rollout.num_generations={count} if every line has {count}.",
        )
    if count < G or not all(isinstance(c, (str, list)) for c in completions):
        return Problem(
            where,
            f"has {count} completions, not {G} strings or episodes",
            f"Give rollout.num_generations={G} strings (or episodes: lists of the messages after the prompt).",
        )
    for j, c in enumerate(completions):
        problem = _episode_problem(where, value["prompt"], j, c) if isinstance(c, list) else None
        if problem is not None:
            return problem
    return _enter(where, value["prompt"], completions, table, first, n)


def _episode_problem(where: str, prompt: Any, j: int, episode: list) -> Problem | None:
    """Completion ``j`` of a line, a multi-turn episode: its prompt is messages and it is messages."""
    if not isinstance(prompt, list):
        return Problem(
            where,
            f"completion {j} is an episode (a list of messages), but the prompt is not messages",
            'Give the prompt as messages ({"prompt": [{"role": "user", "content": ...}], ...}), as the data '
            "holds it: an episode is rendered by the chat template after it.",
        )
    why = episode_problem(episode)
    if why is not None:
        return Problem(
            where,
            f"completion {j} is not an episode: {why}",
            'Give the messages after the prompt: [{"role": "assistant", "content": ..., "tool_calls": [...]}, '
            '{"role": "tool", "content": ...}, {"role": "assistant", "content": ...}].',
        )
    return None


def _ids_line(where: str, value: dict, G: int, table: dict[str, list], first: dict[str, int], n: int) -> Problem | None:
    """A line that gives its completions as token ids (``completion_ids``: G lists of ids, as a
    sampler drew them, eos included where it ended; ``rollout.save_completions`` writes them):
    trained exactly, never re-tokenized."""
    ids = value["completion_ids"]
    if "prompt" not in value or not isinstance(ids, list):
        return Problem(
            where, "is not {prompt, completion_ids}", 'Write {"prompt": ..., "completion_ids": [[ids], ...]}.'
        )
    if len(ids) != G or not all(
        isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row)
        for row in ids
    ):
        return Problem(
            where,
            f"has {len(ids)} completion_ids, not {G} lists of token ids (integers >= 0)",
            f"Give rollout.num_generations={G} lists of token ids.",
        )
    episodes = _saved_episodes(where, value, ids)
    if isinstance(episodes, Problem):
        return episodes
    return _enter(where, value["prompt"], episodes or ids, table, first, n)


def _saved_episodes(where: str, value: dict, ids: list[list[int]]) -> list[Episode] | Problem | None:
    """A ``completion_ids`` line's live episodes, as ``rollout.save_completions`` wrote them: with
    ``policy_masks`` (per completion, 1 where the policy wrote the token), and optionally
    ``prompt_ids`` (the prompt as rendered with its tools) and ``episodes`` (the messages, for the
    rewards); None for a line without masks."""
    if "policy_masks" not in value:
        if "prompt_ids" in value or "episodes" in value:
            return Problem(where, "gives prompt_ids or episodes without policy_masks", _SAVED_SHAPE)
        return None
    G, masks = len(ids), value["policy_masks"]
    if (
        not isinstance(masks, list)
        or len(masks) != G
        or not all(
            isinstance(m, list) and len(m) == len(row) and all(x in (0, 1) for x in m)
            for m, row in zip(masks, ids, strict=True)
        )
    ):
        return Problem(
            where, f"its policy_masks are not {G} lists of 0/1, one per token of each completion", _SAVED_SHAPE
        )
    prompts = value.get("prompt_ids", [None] * G)
    if (
        not isinstance(prompts, list)
        or len(prompts) != G
        or not all(
            p is None
            or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p))
            for p in prompts
        )
    ):
        return Problem(where, f"its prompt_ids are not {G} non-empty lists of token ids", _SAVED_SHAPE)
    messages = value.get("episodes", [[] for _ in range(G)])
    if not isinstance(messages, list) or len(messages) != G:
        return Problem(where, f"its episodes are not {G} lists of messages", _SAVED_SHAPE)
    for j, episode in enumerate(messages):
        why = episode_problem(episode) if episode else None
        if why is not None:
            return Problem(where, f"episode {j} is not an episode: {why}", _SAVED_SHAPE)
    out = []
    for row, mask, prompt, episode in zip(ids, masks, prompts, messages, strict=True):
        last = next((m for m in reversed(episode) if m.get("role") == "assistant"), {})
        out.append(Episode(row, [bool(x) for x in mask], episode, last.get("content") or "", prompt))
    return out


_SAVED_SHAPE = (
    'Write {"prompt": ..., "completion_ids": [G lists], "policy_masks": [G lists of 0/1], "prompt_ids": [G lists], '
    '"episodes": [G lists of messages]} (rollout.save_completions writes each episode\'s policy_mask, prompt_ids '
    "and messages)."
)


def _enter(where: str, prompt: Any, completions: list, table: dict[str, list], first: dict[str, int], n: int):
    """A line's completions into ``table`` under its prompt; a prompt given again with others is refused."""
    key = prompt_key(prompt)
    if key in table and table[key] != completions:
        return Problem(
            where,
            f"gives the prompt of line {first[key]} again, with other completions",
            "Give each prompt once (merge or drop one of the two lines).",
        )
    table[key], first[key] = completions, first.get(key, n)
    return None


class GeneratedRollout:
    """``rollout.backend: hf`` (and any backend that generates): the step's prompts through a
    ``Generator`` (``llmft.model.generate``), sampled with ``rollout.*``, seeded per generation batch
    and data-parallel rank (``generation_seed``)."""

    def __init__(self, recipe: Recipe, generator: Generator, eos: set[int]) -> None:
        self.cfg, self.generator, self.eos, self.seed = recipe.rollout, generator, eos, recipe.run.seed

    def start(self, prompts: list[Prompt], generation: int, dp_rank: int) -> Pending:
        """``rollout.async``: ``complete_scored``'s completions, drawn while the caller goes on (the
        generator's ``start``: the weights synced now, the drawing in a thread)."""
        how = self.sampling(generation, dp_rank, greedy=False, logprobs=True, phases=False)
        future = self.generator.start([p.ids for p in prompts], how)  # type: ignore[attr-defined]
        return Pending(tuple(p.position for p in prompts), future, self._cut)

    def sampling(self, generation: int, dp_rank: int, *, greedy: bool, logprobs: bool, phases: bool) -> Generation:
        """How a generation batch is drawn: ``rollout.*``, seeded by (``run.seed``, batch, rank)."""
        cfg = self.cfg
        return Generation(
            max_new_tokens=cfg.max_new_tokens,
            greedy=greedy,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=generation_seed(self.seed, generation, dp_rank),
            batch_size=cfg.batch_size,
            phases=phases,
            logprobs=logprobs,
            eos=tuple(sorted(self.eos)),
        )

    def _cut(
        self, rows: list[list[int]], scored: list[list[float]] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The drawn rows ended at their first eos (or ``rollout.max_new_tokens``), their log-probs (if
        any) cut alike."""
        completions = [end_at_eos(row, self.eos, self.cfg.max_new_tokens) for row in rows]
        if scored is None:
            return completions, []
        return completions, [logps[: len(c)] for logps, c in zip(scored, completions, strict=True)]

    @property
    def sync_s(self) -> float:
        """Seconds the last generation spent giving the sampler the trainer's weights (0: none needed)."""
        return float(getattr(self.generator, "sync_s", 0.0))

    def close(self) -> None:
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()

    def complete(self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False) -> list[list[int]]:
        """Every rank calls this with the same number of prompts (the step's local batch, or an eval
        shard padded to equal): sharded engines join each generate() call together. A stop request
        abandons the generation on every rank together (``llmft.model.generate``): cut completions
        are never trained on or scored."""
        return self.complete_scored(prompts, generation, dp_rank, greedy, logprobs=False)[0]

    def complete_scored(
        self, prompts: list[Prompt], generation: int, dp_rank: int, greedy: bool = False, logprobs: bool = True
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``complete``'s completions and the sampler's log-prob of each of their tokens (cut as the
        completion is; empty lists without ``logprobs``)."""
        how = self.sampling(generation, dp_rank, greedy=greedy, logprobs=logprobs, phases=True)
        ids = [p.ids for p in prompts]
        if not logprobs:  # a backend needs no more than ``generate``
            return self._cut(self.generator.generate(ids, how))
        sample = getattr(self.generator, "sample", None)
        if sample is None:
            raise UserError(
                Problem(
                    "rl.importance_correction",
                    f"is tis, but the generation backend ({type(self.generator).__name__}) gives no log-probs "
                    "(it has no sample method)",
                    "Set rl.importance_correction=none, or give the backend a sample(prompts, how) that returns the "
                    "completions and their log-probs (llmft.model.generate.Generator).",
                )
            )
        return self._cut(*sample(ids, how))


class Pending:
    """``rollout.async``: a generation batch being drawn while the policy updates (``GeneratedRollout.start``)."""

    def __init__(self, positions: tuple[int, ...], future: Any, cut: Callable[..., Any]) -> None:
        self.positions, self.future, self.cut = positions, future, cut

    def result(self) -> tuple[list[list[int]], list[list[float]]]:
        return self.cut(*self.future.result())


def generation_seed(seed: int, generation: int, dp_rank: int) -> int:
    """The sampling seed of one rank's share of one generation batch (a pure function: resumes match)."""
    return (seed * 1_000_003 + generation * 7919 + dp_rank * 104_729 + 17) % (2**63 - 1)


def make_rollout(recipe: Recipe, tokenizer: Any, model: torch.nn.Module, device: torch.device, synced: bool, autocast):
    """The backend ``rollout.backend`` names; ``hf`` generates on ``model`` (``HFGenerator``), ``vllm``
    in a vLLM engine that gets ``model``'s weights before each generation (``VLLMGenerator``)."""
    if recipe.rollout.backend == "file":
        return FileRollout(recipe, tokenizer, model.get_input_embeddings().num_embeddings)
    ends = eos_ids(tokenizer)
    generator: Generator
    if recipe.rollout.backend == "vllm":
        generator = vllm_backend.vllm_generator(recipe, model, tokenizer, device)
    else:
        generator = HFGenerator(model, tokenizer.pad_token_id, list(ends), device, synced, autocast)
    return GeneratedRollout(recipe, generator, set(ends))
