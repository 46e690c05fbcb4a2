"""The GRPO objective on hand-made prompt micro-batches (file rollouts, one process): any split of the
global batch is the same gradient, the loss is the global completion-token mean (and its two
alternatives), and the numbers match a plain per-completion computation written here."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import save_tiny_pretrained, write_recipe

from llmft.data.encode import IGNORE_INDEX
from llmft.objectives.grpo import advantages

PROMPTS = ["reverse abc:", "reverse hello:", "reverse xy:"]
ANSWERS = ["cba", "olleh", "yx"]
G = 4
COMPLETIONS = {
    "reverse abc:": ["cba", "cb", "abc", "c"],
    "reverse hello:": ["olleh", "olle", "hello there", "o"],
    "reverse xy:": ["yx", "y", "xyxyxy", ""],
}


def test_advantages_by_group_batch_and_none():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 3.0], dtype=torch.float64)
    g = advantages(r, 4, "group")
    first = (r[:4] - r[:4].mean()) / (r[:4].std() + 1e-4)
    assert torch.allclose(g[:4], first)
    assert torch.allclose(advantages(r, 4, "none"), torch.cat([r[:4] - r[:4].mean(), r[4:] - r[4:].mean()]))
    b = advantages(r, 4, "batch")
    assert torch.allclose(b, torch.cat([r[:4] - r[:4].mean(), r[4:] - r[4:].mean()]) / (r.std() + 1e-4))


def _setup(tmp_path, normalise="global_token", micro=4, global_batch=12, beta=0.0, iterations=1, peft="none"):
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.engines.base import OneProcessModels
    from llmft.job.dist import DistEnv
    from llmft.model.build import prepare_model
    from llmft.objectives import ObjectiveSetup, build_objective
    from llmft.plan.resolve import load_plan

    model_dir = tmp_path / "model"
    if not model_dir.exists():
        save_tiny_pretrained(model_dir, seed=1)
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(json.dumps({"prompt": p, "completions": c}) + "\n" for p, c in COMPLETIONS.items()))
    recipe = write_recipe(
        tmp_path,
        model__name_or_path=str(model_dir),
        model__config=None,
        train__objective="grpo",
        batch__global_batch_size=global_batch,
        batch__micro_batch_size=micro,
        rollout__num_generations=G,
        rollout__max_new_tokens=16,
        rollout__backend="file",
        rollout__file=str(rollouts),
        rl__normalise=normalise,
        rl__beta=beta,
        rl__iterations=iterations,
        rewards=[
            {"function": "grpo_rewards:per_char", "weight": 1.0},
            {"function": "grpo_rewards:length", "weight": 0.5},
        ],
        peft__method=peft,
        optim__name="sgd",
    )
    plan = load_plan(recipe)
    tok = byte_tokenizer()
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = prepare_model(plan, tok, device)
    objective = build_objective(plan, OneProcessModels(plan, model, tok, device))
    objective.setup(ObjectiveSetup(data=None, env=DistEnv(), tokenizer=tok))
    return plan, model, objective, tok


def _micro_batches(tok, micro: int, start: int = 0, n: int = 12):
    """The step's items (3 prompts x G) as the data layer collates them, ``micro`` a micro-batch."""
    items = []
    for q in range(start, start + n):
        prompt = PROMPTS[(q // G) % len(PROMPTS)]
        ids = torch.tensor(tok(prompt)["input_ids"])
        items.append((ids, {"prompt": prompt, "answer": ANSWERS[(q // G) % len(PROMPTS)]}, q))
    out = []
    for k in range(0, n, micro):
        chunk = items[k : k + micro]
        out.append(
            {
                "prompt_ids": [i for i, _, _ in chunk],
                "records": [r for _, r, _ in chunk],
                "positions": torch.tensor([q for _, _, q in chunk]),
            }
        )
    return out


def _grad(model, objective, tok, micro):
    model.zero_grad()
    batches = objective.prepare(_micro_batches(tok, micro))
    count = sum(objective.count(b) for b in batches)
    total = 0.0
    for b in batches:
        loss, _ = objective.micro_loss(model, b, torch.tensor(float(count)))
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, count


@pytest.mark.parametrize("normalise", ["global_token", "sequence", "constant"])
def test_any_split_is_the_big_batch(tmp_path, normalise):
    plan, model, objective, tok = _setup(tmp_path, normalise=normalise)
    big_loss, big, _ = _grad(model, objective, tok, micro=12)
    for micro in (1, 3, 4):
        loss, small, _ = _grad(model, objective, tok, micro=micro)
        assert abs(loss - big_loss) < 1e-6 * max(1.0, abs(big_loss))
        for name in big:
            assert torch.allclose(small[name], big[name], atol=1e-7, rtol=1e-5), name


def _plain_loss(model, tok, normalise: str, max_new: int = 16) -> torch.Tensor:
    """The same loss, one completion at a time, from the definitions (docs/rl.md)."""
    import grpo_rewards

    rewards, seqs = [], []
    for prompt, answer in zip(PROMPTS, ANSWERS, strict=True):
        for text in COMPLETIONS[prompt]:
            completion_ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            # the reward sees the decoded completion, as the objective does
            decoded = tok.decode(completion_ids, skip_special_tokens=True)
            rewards.append(grpo_rewards.per_char(prompt, decoded, answer) + 0.5 * grpo_rewards.length(prompt, decoded))
            seqs.append((tok(prompt)["input_ids"], completion_ids))
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = advantages(r, G, "group").float()
    terms, tokens = [], 0
    for (p, c), a in zip(seqs, adv, strict=True):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        per_token = -(torch.exp(logp - logp.detach()) * a)  # ratio 1, no clipping active
        tokens += len(c)
        terms.append((per_token.sum(), per_token.mean()))
    if normalise == "global_token":
        return sum(t for t, _ in terms) / tokens
    if normalise == "sequence":
        return sum(m for _, m in terms) / len(terms)
    return sum(t for t, _ in terms) / (len(terms) * max_new)


@pytest.mark.parametrize("normalise", ["global_token", "sequence", "constant"])
def test_gradient_matches_the_plain_definition(tmp_path, normalise):
    plan, model, objective, tok = _setup(tmp_path, normalise=normalise)
    _, grads, _ = _grad(model, objective, tok, micro=4)
    model.zero_grad()
    _plain_loss(model, tok, normalise).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-7, rtol=1e-4), name


def test_update_batch_is_one_packed_row_with_completion_labels(tmp_path):
    plan, model, objective, tok = _setup(tmp_path)
    (batch, *_) = objective.prepare(_micro_batches(tok, micro=4))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    labels, index = batch["labels"][0], batch["sequence_index"][0]
    prompt_len = len(tok(PROMPTS[0])["input_ids"])
    for i, text in enumerate(COMPLETIONS[PROMPTS[0]]):
        mine = labels[index == i]
        assert (mine[:prompt_len] == IGNORE_INDEX).all()
        assert mine[prompt_len:].tolist() == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert batch["completion_lengths"].tolist() == [len(t) + 1 for t in COMPLETIONS[PROMPTS[0]]]


def test_iterations_reuse_the_generation_batch_and_its_old_logps(tmp_path):
    plan, model, objective, tok = _setup(tmp_path, iterations=2)
    first = objective.prepare(_micro_batches(tok, micro=4))
    assert "old_logps" in first[0]
    again = objective.prepare(_micro_batches(tok, micro=4))
    assert again is first


def test_beta_uses_the_adapters_disabled_reference(tmp_path):
    plan, model, objective, tok = _setup(tmp_path, beta=0.1, peft="lora")
    assert plan.reference == "adapters_disabled"
    (batch, *_) = objective.prepare(_micro_batches(tok, micro=4))
    assert "reference_logps" in batch
    loss, sums = objective.micro_loss(model, batch, torch.tensor(10.0))
    assert float(sums[0]) == pytest.approx(0.0, abs=1e-6)  # adapters start at B=0: policy == reference


def test_a_reward_model_scores_prompt_and_completion_as_transformers_does(tmp_path):
    """``rewards: [{model: DIR}]``: a one-label sequence classifier scores prompt + completion + eos
    (as a reward model trained on pairs saw them); a batch of different lengths scores each row as
    transformers scores it alone."""
    from helpers import TINY_LLAMA, reward_scores
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.objectives.rewards import Rewards

    tok = byte_tokenizer()
    torch.manual_seed(3)
    config = AutoConfig.for_model(**{**TINY_LLAMA, "num_labels": 1, "pad_token_id": tok.pad_token_id})
    rm_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    rewards = Rewards([{"model": str(rm_dir), "weight": 2.0}], torch.device("cpu"), tok)
    prompts, completions = ["reverse abc:", "reverse hello:"], ["cba", "olleh and more"]
    scores = rewards.score(prompts, completions, [{"prompt": p} for p in prompts])
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    alone = torch.cat([reward_scores(model, tok, [p + c]) for p, c in zip(prompts, completions, strict=True)])
    assert rewards.names == ("rm",)
    assert torch.allclose(scores[:, 0].float(), alone, atol=1e-5)
    assert torch.allclose(rewards.total(scores), 2.0 * scores[:, 0])


def test_a_missing_reward_model_says_what_and_where(tmp_path):
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.errors import UserError
    from llmft.objectives.rewards import Rewards

    with pytest.raises(UserError, match=r"rewards\[0\]\.model: cannot load reward model '.*nowhere' \("):
        Rewards([{"model": str(tmp_path / "nowhere")}], torch.device("cpu"), byte_tokenizer())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_head_gives_the_plain_gradient(tmp_path, temperature):
    """``model.chunked_loss``: the completion tokens' log-probs a chunk at a time (at temperature 1;
    another temperature scales the plain logits), the same gradient as the plain logits."""
    from llmft.model import loss as lm_loss

    plan, model, objective, tok = _setup(tmp_path)
    objective.cfg.temperature = temperature
    _, plain, _ = _grad(model, objective, tok, micro=4)
    lm_loss.install(model, chunk_tokens=7)
    assert lm_loss.find(model) is not None
    _, chunked, _ = _grad(model, objective, tok, micro=4)
    for name in plain:
        assert torch.allclose(chunked[name], plain[name], atol=1e-7, rtol=1e-4), name
