"""Preference objectives (llmft/objectives/preference.py, docs/preference.md) on a tiny Llama.

- per-sequence log-probs from the contract batch equal a per-sequence loop, and padding-free rows
  equal padded ones to 1e-6;
- every loss equals a straightforward per-pair implementation of its formula, and TRL's (1.16.0)
  loss functions on the same log-probs;
- the real loop on the single engine: micro 4 x acc 1 == 2 x 2 == 1 x 4 and a short last
  micro-batch give the same gradients (<= 1e-6 relative, fp32) for sigmoid, ipo and simpo, with
  the LoRA (adapters disabled) and the full fine-tune (frozen copy) reference;
- dropout is off in the policy and the reference.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_LLAMA
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

from llmft.job.dist import DistEnv
from llmft.objectives import build_objective
from llmft.objectives.preference import pair_losses
from llmft.objectives.sequences import sequence_logps
from llmft.plan.batch import solve_batch
from llmft.recipe.schema import PreferenceConfig


def tiny_llama(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**TINY_LLAMA)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()


def loop_logps(model, pairs) -> tuple[list[float], list[int]]:
    """Each sequence alone, its target tokens' log-probs summed in a Python loop."""
    sums, counts = [], []
    for ids, labels in sequences(pairs):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        total, n = 0.0, 0
        for t in range(len(ids) - 1):
            if labels[t + 1] != -100:
                total += float(logp[t, labels[t + 1]])
                n += 1
        sums.append(total)
        counts.append(n)
    return sums, counts


def batch_logps(model, batch):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():  # no cache: transformers reads packed boundaries from position_ids only then
        logits = model(**inputs, use_cache=False).logits
    return sequence_logps(logits, batch["labels"], batch["sequence_index"], 2 * batch["num_pairs"])


def test_sequence_logps_equal_a_per_sequence_loop_padded_and_padding_free():
    model, pairs = tiny_llama(), make_pairs(6)
    want_sums, want_counts = loop_logps(model, pairs)
    for packed in (False, True):
        sums, counts = batch_logps(model, collate_pairs(pairs, packed=packed))
        assert counts.tolist() == want_counts
        assert torch.allclose(sums.double(), torch.tensor(want_sums, dtype=torch.float64), rtol=1e-6, atol=1e-5)
    padded, free = (batch_logps(model, collate_pairs(pairs, packed=p))[0] for p in (False, True))
    assert (padded - free).abs().max() <= 1e-6 * padded.abs().max()


# --- the formulas --------------------------------------------------------------------------------


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(cfg, pc, pr, rc, rr) -> float:
    """One pair's loss, written out from the papers (docs/preference.md)."""
    b = cfg.beta
    if cfg.loss_type == "simpo":
        return -_logsig(b * (pc - pr) - cfg.simpo_gamma)
    if cfg.loss_type == "orpo":
        odds = (pc - math.log(1 - math.exp(pc))) - (pr - math.log(1 - math.exp(pr)))
        return -pc - b * _logsig(odds)
    h = (pc - rc) - (pr - rr)
    if cfg.loss_type == "sigmoid":
        return -(1 - cfg.label_smoothing) * _logsig(b * h) - cfg.label_smoothing * _logsig(-b * h)
    if cfg.loss_type == "hinge":
        return max(0.0, 1 - b * h)
    return (h - 1 / (2 * b)) ** 2  # ipo


CASES = [
    PreferenceConfig(loss_type="sigmoid"),
    PreferenceConfig(loss_type="sigmoid", label_smoothing=0.2, beta=0.5),
    PreferenceConfig(loss_type="hinge", beta=0.3),
    PreferenceConfig(loss_type="ipo", beta=0.2),
    PreferenceConfig(loss_type="simpo", beta=2.0, simpo_gamma=0.7),
    PreferenceConfig(loss_type="orpo", beta=0.25),
]
IDS = ["sigmoid", "cdpo", "hinge", "ipo", "simpo", "orpo"]


def _logps(seed: int, n: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(n, generator=g, dtype=torch.float64) * 3 + 0.05) for _ in range(4)]


@pytest.mark.parametrize("cfg", CASES, ids=IDS)
def test_pair_losses_equal_the_formulas(cfg):
    pc, pr, rc, rr = _logps(0)
    out = pair_losses(cfg, pc, pr, rc, rr)
    want = [reference_loss(cfg, *(float(t[i]) for t in (pc, pr, rc, rr))) for i in range(len(pc))]
    assert torch.allclose(out.losses, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", CASES, ids=IDS)
def test_pair_losses_equal_trl(cfg):
    """TRL 1.16.0's loss functions (CPOTrainer.cpo_loss for sigmoid / hinge / ipo / simpo on the
    log-ratios, ORPOTrainer.odds_ratio_loss) on the same log-probs. TRL's DPOTrainer of 1.16 has
    no cDPO smoothing and weights IPO by the sequences' probabilities (docs/preference.md);
    CPOTrainer keeps the classic formulas."""
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    pc, pr, rc, rr = _logps(1)
    ours = pair_losses(cfg, pc, pr, rc, rr)
    this = SimpleNamespace(
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        loss_type=cfg.loss_type,
        simpo_gamma=cfg.simpo_gamma,
        alpha=0.0,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    if cfg.loss_type == "orpo":
        ratio, *_ = ORPOTrainer.odds_ratio_loss(this, pc, pr)
        trl = -pc.float() - ratio  # TRL: NLL of the chosen minus beta * log sigmoid(log odds)
        assert torch.allclose(ours.losses.float(), trl, rtol=1e-6, atol=1e-6)
        return
    if cfg.loss_type == "simpo":
        trl, chosen_r, rejected_r = CPOTrainer.cpo_loss(this, pc, pr)
    else:
        trl, chosen_r, rejected_r = CPOTrainer.cpo_loss(this, pc - rc, pr - rr)
    assert torch.allclose(ours.losses, trl, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ours.chosen_rewards, chosen_r) and torch.allclose(ours.rejected_rewards, rejected_r)


@pytest.mark.parametrize("average", [False, True])
def test_sequence_logps_equal_trl_get_batch_logps(average):
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    model, pairs = tiny_llama(), make_pairs(5, seed=3)
    batch = collate_pairs(pairs)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sums, counts = sequence_logps(logits, batch["labels"], batch["sequence_index"], 10)
    trl = CPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=average)
    assert torch.allclose(sums / counts if average else sums, trl, rtol=1e-6, atol=1e-6)


# --- the loop: accumulation is the big batch ---------------------------------------------------------


def _plan(tmp_path, loss_type: str, method: str, micro: int, *extra: str):
    return preference_plan(tmp_path, "dpo", method, micro, f"preference.loss_type={loss_type}", *extra)


SPLITS = [4, 2, 1]


@pytest.mark.parametrize("method", ["lora", "none"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_accumulation_is_the_big_batch(tmp_path, loss_type, method):
    """micro 4 x acc 1 == 2 x 2 == 1 x 4, and 2 + 2 + 1 pairs (a short last micro-batch) == 5 at once."""
    pairs = make_pairs(4, seed=7)
    grads, rows = {}, {}
    for micro in SPLITS:
        plan = _plan(tmp_path / str(micro), loss_type, method, micro)
        assert plan.reference == (
            "none" if loss_type == "simpo" else "adapters_disabled" if method == "lora" else "frozen_copy"
        )
        grads[micro], rows[micro] = preference_step(plan, DistEnv(), micro_batches(pairs, micro))
    for micro in SPLITS[1:]:
        assert rel_diff(grads[micro], grads[4]) <= 1e-6
        for key in ("loss", "rewards/chosen", "rewards/accuracy", "rewards/margin", "logps/rejected"):
            assert abs(rows[micro][key] - rows[4][key]) <= 1e-6 * max(1.0, abs(rows[4][key]))

    five = make_pairs(5, seed=8)
    plan = _plan(tmp_path / "short", loss_type, method, 1)
    whole, _ = preference_step(plan, DistEnv(), micro_batches(five, 5), solve_batch(5, 5, 1, 1))
    short, _ = preference_step(plan, DistEnv(), micro_batches(five, 2), solve_batch(6, 2, 3, 1))
    assert rel_diff(short, whole) <= 1e-6


def test_padding_free_gradients_equal_padded(tmp_path):
    pairs = make_pairs(4, seed=9)
    plan = _plan(tmp_path, "sigmoid", "lora", 2)
    padded, _ = preference_step(plan, DistEnv(), micro_batches(pairs, 2))
    free, _ = preference_step(plan, DistEnv(), micro_batches(pairs, 2, packed=True))
    assert rel_diff(free, padded) <= 1e-6


def test_rewards_are_zero_at_the_start_and_dropout_is_off(tmp_path):
    """At step 0 the policy is its reference: every reward is 0, the sigmoid loss is log 2, and a
    model configured with dropout computes it deterministically (the loop calls model.train())."""
    pairs = make_pairs(4, seed=11)
    for method in ("lora", "none"):
        plan = _plan(tmp_path / method, "sigmoid", method, 2, "peft.dropout=0.5")
        _, row = preference_step(plan, DistEnv(), micro_batches(pairs, 2))
        assert abs(row["loss"] - math.log(2)) < 1e-6
        assert row["rewards/chosen"] == row["rewards/rejected"] == row["rewards/margin"] == 0.0
        assert row["rewards/accuracy"] == 0.0  # ties are not correct
        assert row["logps/chosen"] < 0 and row["logps/rejected"] < 0


# --- the reference -----------------------------------------------------------------------------------


def _engine(plan):
    from llmft.data.tokenizer import load_tokenizer
    from llmft.engines import build_engine
    from llmft.training.optim import build_optimizer

    optim = plan.recipe.optim
    return build_engine(plan, DistEnv(), load_tokenizer(plan.recipe.model), lambda m: build_optimizer(m, optim, 1.0))


def test_lora_reference_is_the_base_model_with_adapters_disabled(tmp_path):
    """With trained (non-zero) adapters, the reference log-probs are the base model's, the policy's
    differ, and the adapters are trainable again afterwards."""
    from llmft.model.build import build_model
    from llmft.objectives import build_objective

    plan = _plan(tmp_path / "lora", "sigmoid", "lora", 2)
    engine = _engine(plan)
    objective = build_objective(plan, engine)
    with torch.no_grad():
        for name, p in engine.unwrap().named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = collate_pairs(make_pairs(3, seed=2))
    ref_chosen, ref_rejected = objective._reference_logps(batch)
    base = build_model(_plan(tmp_path / "full", "sigmoid", "none", 2).recipe, None, device="cpu").eval()
    want = batch_logps(base, batch)[0]
    assert torch.allclose(torch.stack([ref_chosen, ref_rejected], 1).flatten(), want, rtol=0, atol=1e-5)
    with torch.no_grad():
        policy = objective._logps(engine.model, batch)
    assert (policy[0] - ref_chosen).abs().max() > 1e-2
    assert all(p.requires_grad for n, p in engine.unwrap().named_parameters() if "lora_" in n)


def test_full_fine_tune_reference_keeps_the_initial_weights(tmp_path):
    plan = _plan(tmp_path, "sigmoid", "none", 2, "optim.lr=1.0")
    pairs = make_pairs(4, seed=4)
    engine = _engine(plan)
    initial = {n: p.detach().clone() for n, p in engine.unwrap().named_parameters()}
    reference = build_objective(plan, engine).reference  # the objective asks the engine for it
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    assert reference.state_dict().keys() == engine.unwrap().state_dict().keys()
    preference_step(plan, DistEnv(), micro_batches(pairs, 2))  # its own engine; this one is unchanged
    for name, p in reference.named_parameters():
        assert torch.equal(p, initial[name])


# --- exact resume --------------------------------------------------------------------------------------


def _run(plan, steps: list[list[dict]], start: int, stop: int, load_from=None, save_to=None):
    """Steps ``start`` .. ``stop`` of a dpo run (AdamW) on a new engine (``run_steps``)."""
    return run_steps(plan, _engine(plan), steps, start, stop, load_from, save_to)


@pytest.mark.parametrize("method", ["lora", "none"])
def test_resume_is_bit_exact(tmp_path, method):
    """4 AdamW steps straight == 2 steps, save, a new engine (whose reference is rebuilt from the
    recipe: the initial weights, not the checkpoint's), load, 2 more steps."""
    plan = _plan(tmp_path, "sigmoid", method, 2, "optim.name=adamw", "optim.lr=1e-2")
    pairs = make_pairs(16, seed=6)
    steps = [micro_batches(pairs[i : i + 4], 2) for i in range(0, 16, 4)]
    straight = _run(plan, steps, 0, 4)
    _run(plan, steps, 0, 2, save_to=tmp_path / "ckpt")
    resumed = _run(plan, steps, 2, 4, load_from=tmp_path / "ckpt")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    first_two = _run(plan, steps, 0, 2)
    assert any(not torch.equal(straight[k], first_two[k]) for k in straight)  # the last steps did move


# --- eval on held-out pairs -------------------------------------------------------------------------


def test_eval_reports_the_pair_mean_loss_and_reward_metrics(tmp_path):
    """Eval over 5 held-out pairs in micro-batches of 2 (2 + 2 + 1) equals the objective on all 5 at once."""
    from llmft.data.tokenizer import load_tokenizer
    from llmft.objectives import build_objective
    from llmft.training.evaluate import Evaluator

    plan = _plan(tmp_path, "sigmoid", "lora", 2)
    engine = _engine(plan)
    with torch.no_grad():
        for name, p in engine.unwrap().named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a policy that differs from its reference
    objective = build_objective(plan, engine)
    held_out = make_pairs(5, seed=12)
    data = SimpleNamespace(eval=held_out, eval_prompts=None)
    evaluator = Evaluator(plan, DistEnv(), engine, data, load_tokenizer(plan.recipe.model), objective)
    evaluator.collate = lambda examples, pad_id: collate_pairs(examples)
    row = evaluator.run(step=3)
    whole = collate_pairs(held_out)
    with torch.no_grad():
        loss, sums = objective.micro_loss(engine.model, whole, torch.tensor(5.0))
    want = objective.metrics(sums.tolist(), 5.0)
    assert row["split"] == "eval" and row["step"] == 3 and row["pairs"] == 5
    assert abs(row["loss"] - float(loss)) < 1e-6
    for key, value in want.items():
        assert abs(row[key] - value) <= 1e-6 * max(1.0, abs(value)), key
    assert "perplexity" not in row
