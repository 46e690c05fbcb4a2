"""Reward models (llmft/objectives/reward.py, llmft/model/heads.py, docs/preference.md) on a tiny Llama.

- a sequence's score is the score head's output at its last token: from the contract batch (padded
  rows and a padding-free row alike) it equals transformers' own pooled score of the sequence alone;
- the loss is -log sigmoid(r_chosen - r_rejected) averaged over the pairs, the metrics their means;
- the real loop: micro 4 x acc 1 == 2 x 2 == 1 x 4, a short last micro-batch, and padding-free rows
  give the big batch's gradients (<= 1e-6 relative, fp32), with LoRA (the head trained in full) and a
  full fine-tune;
- a causal-LM checkpoint's missing score head gets llmft's seeded init; LoRA trains the head
  (PEFT's modules_to_save) and freezes the base;
- resolve accepts ``train.objective: reward``, turns the chunked LM loss off and refuses Liger.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import pretrained_model, save_tiny_pretrained, write_recipe
from preference_batches import (
    collate_pairs,
    make_pairs,
    micro_batches,
    preference_plan,
    preference_step,
    rel_diff,
    run_steps,
    sequences,
)

from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.job.dist import DistEnv
from llmft.model.build import build_model
from llmft.model.heads import initial_head_weights
from llmft.objectives.reward import RewardObjective, sequence_scores
from llmft.plan.batch import solve_batch
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe


def _plan(tmp_path, method: str, micro: int, *extra: str):
    return preference_plan(tmp_path, "reward", method, micro, *extra)


def _scorer(tmp_path, method: str = "none"):
    """A reward model of the tiny recipe with a non-trivial head, and its objective."""
    from types import SimpleNamespace

    plan = _plan(tmp_path, method, 2)
    model = build_model(plan.recipe, byte_tokenizer()).eval()
    objective = RewardObjective(plan, SimpleNamespace(unwrap=lambda: model))
    return model, objective


def test_scores_are_the_last_tokens_as_transformers_pools_them_padded_and_padding_free(tmp_path):
    model, objective = _scorer(tmp_path)
    pairs = make_pairs(5, seed=3)
    alone = []
    for ids, _ in sequences(pairs):
        with torch.no_grad():
            alone.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    alone = torch.tensor(alone)
    for packed in (False, True):
        batch = collate_pairs(pairs, packed=packed)
        with torch.no_grad():
            chosen, rejected = objective.scores(model, batch)
        got = torch.stack([chosen, rejected], 1).reshape(-1)
        assert (got - alone).abs().max() <= 1e-6 * max(1.0, float(alone.abs().max())), packed


def test_sequence_scores_pick_each_sequences_last_token():
    token_scores = torch.arange(12.0).reshape(2, 6, 1)
    index = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 3, 3, -1, -1, -1]])
    assert sequence_scores(token_scores, index, 4).tolist() == [1.0, 4.0, 6.0, 8.0]


def test_loss_and_metrics_are_the_pair_means(tmp_path):
    model, objective = _scorer(tmp_path)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores far apart: every metric moves
    batch = collate_pairs(make_pairs(6, seed=4))
    with torch.no_grad():
        chosen, rejected = objective.scores(model, batch)
        loss, sums = objective.micro_loss(model, batch, torch.tensor(6.0))
    c, r = chosen.tolist(), rejected.tolist()
    want_loss = sum(-math.log(1 / (1 + math.exp(-(a - b)))) for a, b in zip(c, r, strict=True)) / 6
    assert abs(float(loss) - want_loss) <= 1e-6 * max(1.0, want_loss)
    m = objective.metrics(sums.tolist(), 6.0)
    assert set(m) == {"rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"}
    assert abs(m["rewards/chosen"] - sum(c) / 6) < 1e-6 and abs(m["rewards/rejected"] - sum(r) / 6) < 1e-6
    assert m["rewards/accuracy"] == sum(a > b for a, b in zip(c, r, strict=True)) / 6
    assert abs(m["rewards/margin"] - (sum(c) - sum(r)) / 6) < 1e-6


SPLITS = [4, 2, 1]


@pytest.mark.parametrize("method", ["lora", "none"])
def test_accumulation_is_the_big_batch(tmp_path, method):
    """micro 4 x acc 1 == 2 x 2 == 1 x 4 (padded and padding-free), and 2 + 2 + 1 pairs == 5 at once."""
    pairs = make_pairs(4, seed=7)
    grads, rows = {}, {}
    for micro in SPLITS:
        plan = _plan(tmp_path / str(micro), method, micro)
        assert plan.reference == "none" and not plan.chunked_loss
        grads[micro], rows[micro] = preference_step(plan, DistEnv(), micro_batches(pairs, micro, packed=micro == 2))
    if method == "lora":  # the head is trained in full, beside the adapters
        assert "base_model.model.score.modules_to_save.default.weight" in grads[4]
        assert not any("original_module" in k or "embed_tokens" in k for k in grads[4])
    else:
        assert "score.weight" in grads[4] and "model.embed_tokens.weight" in grads[4]
    for micro in SPLITS[1:]:
        assert rel_diff(grads[micro], grads[4]) <= 1e-6
        for key in ("loss", "rewards/chosen", "rewards/accuracy", "rewards/margin"):
            assert abs(rows[micro][key] - rows[4][key]) <= 1e-6 * max(1.0, abs(rows[4][key]))

    five = make_pairs(5, seed=8)
    plan = _plan(tmp_path / "short", method, 1)
    whole, _ = preference_step(plan, DistEnv(), micro_batches(five, 5), solve_batch(5, 5, 1, 1))
    short, _ = preference_step(plan, DistEnv(), micro_batches(five, 2), solve_batch(6, 2, 3, 1))
    assert rel_diff(short, whole) <= 1e-6


def test_a_causal_lm_checkpoint_gets_the_seeded_head(tmp_path):
    base = save_tiny_pretrained(tmp_path / "base", seed=3)
    recipe = write_recipe(tmp_path, model=pretrained_model(base))
    plan = resolve(load_recipe(recipe, ["train.objective=reward"]))
    rng = torch.random.get_rng_state()
    a = build_model(plan.recipe, byte_tokenizer())
    assert torch.equal(torch.random.get_rng_state(), rng)  # the new head drew nothing from the global RNG
    b = build_model(plan.recipe, byte_tokenizer())
    assert type(a).__name__ == "LlamaForSequenceClassification" and a.config.num_labels == 1
    assert a.config.pad_token_id == byte_tokenizer().pad_token_id
    want = dict(initial_head_weights(a, plan.recipe.run.seed))["score.weight"]
    assert torch.equal(a.score.weight, want) and torch.equal(b.score.weight, want)
    assert 0.01 < float(want.std()) < 0.03  # transformers' init distribution (initializer_range 0.02)

    lora_plan = resolve(load_recipe(recipe, ["train.objective=reward", "peft.method=lora", "peft.r=4"]))
    lora = build_model(lora_plan.recipe, byte_tokenizer())
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    head = dict(lora.named_parameters())["base_model.model.score.modules_to_save.default.weight"]
    assert torch.equal(head, want)


def test_resolve_accepts_reward_and_refuses_what_it_cannot_do(tmp_path):
    plan = _plan(tmp_path, "lora", 2, "model.chunked_loss=true")
    assert plan.objective_spec.head == "score" and not plan.chunked_loss  # a score head has no vocabulary
    with pytest.raises(UserError) as e:
        _plan(tmp_path, "lora", 2, "model.liger_kernels=true")
    assert (
        "model.liger_kernels: is true, but train.objective=reward trains a score head, not the causal-LM head "
        "Liger's fused loss replaces" in str(e.value)
    )
    with pytest.raises(UserError) as e:
        _plan(tmp_path, "none", 2, "train.eval_generate_samples=10")
    assert (
        "train.eval_generate_samples: is 10, but train.objective=reward trains a score head, which generates no "
        "text. Set train.eval_generate_samples=0" in str(e.value)
    )
    with pytest.raises(UserError) as e:
        _plan(tmp_path, "lora", 2, "preference.beta=0.5")
    assert (
        "preference.beta: is 0.5, but train.objective=reward does not read preference.* (the DPO family's "
        "settings). Remove it (default 0.1), or set train.objective=dpo." in str(e.value)
    )


def _run(plan, steps: list[list[dict]], start: int, stop: int, load_from=None, save_to=None):
    """Steps ``start`` .. ``stop`` of a reward run (AdamW) on a new engine (``run_steps``)."""
    from llmft.engines import build_engine
    from llmft.training.optim import build_optimizer

    optim = plan.recipe.optim
    engine = build_engine(plan, DistEnv(), byte_tokenizer(), lambda m: build_optimizer(m, optim, optim.lr))
    return run_steps(plan, engine, steps, start, stop, load_from, save_to)


@pytest.mark.parametrize("method", ["lora", "none"])
def test_resume_is_bit_exact(tmp_path, method):
    """4 AdamW steps straight == 2 steps, save (the LoRA head saved with the adapter), a new engine, load,
    2 more steps: the head and everything else to the bit."""
    plan = _plan(tmp_path, method, 2, "optim.name=adamw", "optim.lr=1e-2")
    pairs = make_pairs(16, seed=6)
    steps = [micro_batches(pairs[i : i + 4], 2) for i in range(0, 16, 4)]
    straight = _run(plan, steps, 0, 4)
    _run(plan, steps, 0, 2, save_to=tmp_path / "ckpt")
    resumed = _run(plan, steps, 2, 4, load_from=tmp_path / "ckpt")
    assert straight.keys() == resumed.keys() and any("score" in k for k in straight)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    first_two = _run(plan, steps, 0, 2)
    assert all(not torch.equal(straight[k], first_two[k]) for k in straight if "score" in k)  # the head moved


def test_qlora_keeps_the_score_head_unquantized_and_trained(tmp_path):
    """A 4-bit base (bitsandbytes on the CPU here): the decoder's linear layers are packed, the score head
    stays a plain trainable Linear beside the adapters (PEFT's modules_to_save copy)."""
    plan = _plan(tmp_path, "lora", 2, "model.quantization={bits: 4}", "model.dtype=bf16")
    model = build_model(plan.recipe, byte_tokenizer())
    modules = dict(model.named_modules())
    assert type(modules["base_model.model.model.layers.0.mlp.up_proj.base_layer"]).__name__ == "Linear4bit"
    head = modules["base_model.model.score.modules_to_save.default"]
    assert type(head) is torch.nn.Linear and head.weight.requires_grad
    assert not modules["base_model.model.score.original_module"].weight.requires_grad
