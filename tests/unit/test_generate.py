"""Generation is written once (llmft/model/generate.py): the exact-match eval and the ``hf`` rollout
both reach ``HFGenerator``; a fake ``Generator`` replaces it in the rollout (the seam a vLLM backend
takes); its tokens are a plain seeded ``generate()``'s; a stop request ends it on every rank."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import tiny_llama_model, write_recipe

from llmft import stop
from llmft.data.sampler import eval_shard
from llmft.data.tokenizer import byte_tokenizer
from llmft.job.dist import DistEnv
from llmft.model.generate import Generation, Generator, HFGenerator, left_pad
from llmft.objectives.rollout import GeneratedRollout, Prompt, generation_seed, make_rollout
from llmft.plan.resolve import load_plan
from llmft.training.evaluate import Evaluator

TEXTS = ["reverse abc:", "hello there, general", "x", "a much longer prompt than the others", "yz"]
CPU = torch.device("cpu")


def _plan(tmp_path, *overrides: str):
    recipe = write_recipe(
        tmp_path,
        train__objective="grpo",
        rollout__num_generations=2,
        rollout__max_new_tokens=6,
        rollout__batch_size=2,
        rollout__temperature=0.7,
        rollout__top_p=0.9,
        rewards=[{"function": "grpo_rewards:length", "weight": 1.0}],
        train__eval_generate_samples=5,
        train__eval_max_new_tokens=4,
    )
    return load_plan(recipe, ["model.attn_implementation=sdpa", *overrides])


def _prompts(tok) -> list[Prompt]:
    return [Prompt(torch.tensor(tok(t)["input_ids"]), {"prompt": t}, q) for q, t in enumerate(TEXTS)]


def _evaluator(plan, tok, model) -> Evaluator:
    engine = SimpleNamespace(unwrap=lambda: model, autocast=contextlib.nullcontext, model=model)
    prompts = [(np.asarray(tok(t)["input_ids"], dtype=np.int32), t[::-1]) for t in TEXTS]
    return Evaluator(plan, DistEnv(), engine, SimpleNamespace(eval=None, eval_prompts=prompts), tok, None)


def test_eval_and_the_hf_rollout_generate_through_the_one_helper(tmp_path, monkeypatch):
    plan, tok, model = _plan(tmp_path), byte_tokenizer(), tiny_llama_model()
    calls: list[tuple[int, Generation]] = []
    real = HFGenerator.generate

    def spy(self, prompts, how):
        calls.append((len(prompts), how))
        return real(self, prompts, how)

    monkeypatch.setattr(HFGenerator, "generate", spy)
    row = _evaluator(plan, tok, model).run(step=1)
    assert row is not None and row["generated"] == 5
    completions = make_rollout(plan.recipe, tok, model, CPU, False, contextlib.nullcontext).complete(
        _prompts(tok), generation=3, dp_rank=0
    )
    assert len(completions) == 5 and all(0 < len(c) <= 6 for c in completions)
    assert calls == [
        (5, Generation(max_new_tokens=4, batch_size=8, what="eval generation", eos=(tok.eos_token_id,))),
        (
            5,
            Generation(
                max_new_tokens=6,
                greedy=False,
                temperature=0.7,
                top_p=0.9,
                seed=generation_seed(0, 3, 0),
                batch_size=2,
                phases=True,
                eos=(tok.eos_token_id,),
            ),
        ),
    ]


class FakeGenerator:
    """A backend that is not transformers: each completion is its prompt's first ids, then eos, then junk."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.seen: list[tuple[list[list[int]], Generation]] = []

    def generate(self, prompts, how: Generation) -> list[list[int]]:
        self.seen.append(([list(map(int, p)) for p in prompts], how))
        return [[int(t) for t in p[:3]] + [self.eos, 7, 7] for p in prompts]


def test_a_fake_generator_replaces_hf_in_the_rollout(tmp_path):
    plan, tok = _plan(tmp_path), byte_tokenizer()
    fake = FakeGenerator(tok.eos_token_id)
    generator: Generator = fake  # the Protocol is all a backend implements
    rollout = GeneratedRollout(plan.recipe, generator, {tok.eos_token_id})
    prompts = _prompts(tok)
    out = rollout.complete(prompts, generation=2, dp_rank=1, greedy=True)
    # cut after the first eos, whatever the backend appended
    assert out == [[int(t) for t in p.ids[:3]] + [tok.eos_token_id] for p in prompts]
    ((seen, how),) = fake.seen
    assert seen == [p.ids.tolist() for p in prompts]
    assert how.greedy and how.seed == generation_seed(0, 2, 1) and how.max_new_tokens == 6 and how.batch_size == 2


def test_the_grpo_step_trains_on_a_fake_backends_completions(tmp_path):
    """The objective takes any rollout over a ``Generator``: its update batches hold the fake's ids."""
    from llmft.engines.base import OneProcessModels
    from llmft.model.build import prepare_model
    from llmft.objectives import ObjectiveSetup, build_objective

    plan, tok = _plan(tmp_path, "batch.global_batch_size=4", "batch.micro_batch_size=4"), byte_tokenizer()
    torch.manual_seed(0)
    model = prepare_model(plan, tok, CPU)
    objective = build_objective(plan, OneProcessModels(plan, model, tok, CPU))
    objective.setup(ObjectiveSetup(data=None, env=DistEnv(), tokenizer=tok))
    fake = FakeGenerator(tok.eos_token_id)
    objective.rollout = GeneratedRollout(plan.recipe, fake, {tok.eos_token_id})
    prompts = _prompts(tok)[:2]
    items = [p for p in prompts for _ in range(2)]  # 2 prompts x G=2
    (batch,) = objective.prepare(
        [
            {
                "prompt_ids": [p.ids for p in items],
                "records": [p.record for p in items],
                "positions": torch.arange(4),
            }
        ]
    )
    assert len(fake.seen) == 1
    labels = batch["labels"][0]
    want = [t for p in items for t in [*p.ids[:3].tolist(), tok.eos_token_id]]
    assert labels[labels != -100].tolist() == want


def test_the_hf_generator_draws_what_a_plain_seeded_generate_draws(tmp_path):
    """Left-padded rows, the attention mask, the seed in a forked RNG (the caller's RNG untouched)."""
    tok, model = byte_tokenizer(), tiny_llama_model()
    ids = [torch.tensor(tok(t)["input_ids"]) for t in TEXTS]
    how = Generation(max_new_tokens=5, greedy=False, temperature=0.8, top_p=0.95, seed=11, batch_size=None)
    torch.manual_seed(5)
    got = HFGenerator(model, tok.pad_token_id, [tok.eos_token_id], CPU, False).generate(ids, how)
    after = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(2), after)  # the generator forked the RNG

    input_ids, mask = left_pad(ids, tok.pad_token_id)
    width = max(len(i) for i in ids)
    assert all(mask[r, width - len(i) :].all() and not mask[r, : width - len(i)].any() for r, i in enumerate(ids))
    torch.manual_seed(11)
    plain = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
    )
    assert got == plain[:, width:].tolist()


def test_a_stop_request_ends_generation_at_its_next_token_and_every_rank_abandons_it(monkeypatch):
    tok, model = byte_tokenizer(), tiny_llama_model()
    calls: list[int] = []
    real = model.generate

    def counted(**kwargs):
        out = real(**kwargs)
        calls.append(out.shape[1] - kwargs["input_ids"].shape[1])  # new tokens of the call
        return out

    monkeypatch.setattr(model, "generate", counted)
    ids = [torch.tensor(tok(t)["input_ids"]) for t in TEXTS]
    request = stop.StopRequest().install()
    try:
        request.requested = "SIGTERM"
        with pytest.raises(stop.Abandoned) as cut:
            HFGenerator(model, tok.pad_token_id, tok.eos_token_id, CPU, False).generate(
                ids, Generation(max_new_tokens=20, batch_size=2, what="eval generation")
            )
    finally:
        request.uninstall()
    assert cut.value.what == "eval generation"
    assert calls == [1]  # the first call ended after one token; the vote after it cut the rest


@pytest.mark.parametrize("n,world", [(10, 3), (5, 2), (2, 4), (8, 4), (1, 1)])
def test_eval_shards_are_contiguous_cover_every_item_once_and_pad_to_one_size(n, world):
    shards = [eval_shard(n, rank, world) for rank in range(world)]
    assert [i for mine, _ in shards for i in mine] == list(range(n))
    assert {per for _, per in shards} == {-(-n // world)}
    assert all(len(mine) <= per for mine, per in shards)
