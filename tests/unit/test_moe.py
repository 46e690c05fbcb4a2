"""The router's load-balancing loss of mixture-of-experts models over the global batch
(llmft/model/moe.py, llmft/plan/moe.py; docs/moe.md).

Tiny fp32 MoE models (2 layers, 8 experts, top-2) built from ``model.config`` and trained one SGD
step through the real loop (``loop_step`` of tests/unit/test_aux_loss.py) on 4 examples of very
different lengths (padding in every split): the step's loss, balancing loss and gradients equal a
plain transformers forward and backward over the whole batch with ``output_router_logits=True`` and
``router_aux_loss_coef`` = the coefficient, for every split and with activation checkpointing; the
per-micro-batch loss (``moe.balance: micro_batch``) is measurably another; the loss balances the
experts over a short run; and the refusals say what, where and how to fix.
"""

from __future__ import annotations

import pytest
import torch
from helpers import write_recipe
from test_aux_loss import GLOBAL, SPLITS, examples, loop_step

from llmft.data import collate

COEF = 0.5
SHAPE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
}
FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32, **SHAPE},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, **SHAPE},
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 8, "layer_types": ["full_attention"] * 2, **SHAPE},
    # Latent attention, a shared expert, a dense first layer and routing balanced without a loss.
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        **SHAPE,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "rope_scaling": None,
    },
}
TOL = 1e-5


def plan_for(tmp_path, config: dict, micro: int, *extra: str, global_batch: int = GLOBAL):
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    overrides = [
        f"batch.global_batch_size={global_batch}",
        f"batch.micro_batch_size={micro}",
        "optim.name=sgd",
        "optim.max_grad_norm=null",
        *extra,
    ]
    return resolve(load_recipe(write_recipe(tmp_path, model__config=config), overrides))


def split_step(tmp_path, family: str, micro: int, *extra: str) -> tuple[dict, dict]:
    """One step in one process over the 4 examples in micro-batches of ``micro``."""
    from llmft.job.dist import DistEnv

    plan = plan_for(tmp_path / f"{family}-{micro}-{len(extra)}", FAMILIES[family], micro, *extra)
    exs = examples()
    return loop_step(plan, DistEnv(), [collate(exs[i : i + micro], 0) for i in range(0, len(exs), micro)])


def hf_big_batch(config: dict, coef: float) -> tuple[dict, dict]:
    """A plain transformers forward and backward over the whole batch, the family's own balancing
    loss on (``output_router_logits=True``, ``router_aux_loss_coef=coef``): (gradients, values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**config, "router_aux_loss_coef": coef})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # run.seed: llmft builds the same weights
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    model.train()
    out = model(**collate(examples(), 0), use_cache=False, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return grads, {"total": float(out.loss.detach()), "aux/moe_balance": coef * float(out.aux_loss.detach())}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_one_process_big_batch_equals_transformers(tmp_path, family):
    want, values = hf_big_batch(FAMILIES[family], COEF)
    grads, row = split_step(tmp_path, family, GLOBAL, f"moe.aux_loss_coef={COEF}")
    assert max_abs_diff(grads, want) <= TOL, max_abs_diff(grads, want)
    assert row["aux/moe_balance"] == pytest.approx(values["aux/moe_balance"], rel=TOL)
    assert row["loss"] + row["aux/moe_balance"] == pytest.approx(values["total"], rel=TOL)  # counted once
    assert row["aux/moe_balance"] > 0.1 * row["loss"]  # a coefficient that matters


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_every_split_equals_the_big_batch_and_micro_batch_balance_does_not(tmp_path, family):
    want, values = hf_big_batch(FAMILIES[family], COEF)
    for micro, acc in SPLITS[1:]:
        grads, row = split_step(tmp_path, family, micro, f"moe.aux_loss_coef={COEF}")
        assert max_abs_diff(grads, want) <= TOL, (micro, acc, max_abs_diff(grads, want))
        assert row["aux/moe_balance"] == pytest.approx(values["aux/moe_balance"], rel=TOL)
    # The control: transformers' loss per micro-batch, averaged, is another gradient on a split.
    grads, row = split_step(tmp_path, family, 2, f"moe.aux_loss_coef={COEF}", "moe.balance=micro_batch")
    assert max_abs_diff(grads, want) > 1e-3
    assert abs(row["aux/moe_balance"] - values["aux/moe_balance"]) > 1e-3


def test_activation_checkpointing_counts_the_loss_once(tmp_path):
    want, values = hf_big_batch(FAMILIES["qwen3_moe"], COEF)
    extra = (f"moe.aux_loss_coef={COEF}", "model.gradient_checkpointing=true")
    grads, row = split_step(tmp_path, "qwen3_moe", 2, *extra)
    assert max_abs_diff(grads, want) <= TOL, max_abs_diff(grads, want)
    assert row["aux/moe_balance"] == pytest.approx(values["aux/moe_balance"], rel=TOL)


def test_default_coefficient_is_the_configs_and_zero_is_off(tmp_path):
    config = {**FAMILIES["qwen3_moe"], "router_aux_loss_coef": 0.25}
    want, values = hf_big_batch(config, 0.25)
    from llmft.job.dist import DistEnv

    plan = plan_for(tmp_path / "default", config, 2)
    exs = examples()
    grads, row = loop_step(plan, DistEnv(), [collate(exs[:2], 0), collate(exs[2:], 0)])
    assert max_abs_diff(grads, want) <= TOL
    assert row["aux/moe_balance"] == pytest.approx(values["aux/moe_balance"], rel=TOL)
    # Off: no term, and transformers' own addition to .loss stays off too (the task loss alone).
    want_off, values_off = hf_big_batch(config, 0.0)
    plan = plan_for(tmp_path / "off", config, 2, "moe.aux_loss_coef=0")
    grads, row = loop_step(plan, DistEnv(), [collate(exs[:2], 0), collate(exs[2:], 0)])
    assert max_abs_diff(grads, want_off) <= TOL
    assert not [k for k in row if k.startswith(("aux/", "moe/"))]
    assert row["loss"] == pytest.approx(values_off["total"], rel=TOL)


def test_expert_load_metrics_are_the_global_batchs(tmp_path):
    """moe/load_max_over_mean (worst layer), moe/load_max_over_mean_avg, moe/router_entropy: the
    same for every split, from the routing of the whole batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.model.moe import routing_sums

    cfg = AutoConfig.for_model(**FAMILIES["qwen3_moe"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    batch = collate(examples(), 0)
    with torch.no_grad():
        out = model(**batch, use_cache=False, output_router_logits=True)
    stats = routing_sums(out.router_logits, batch["attention_mask"], 8, 2)
    tokens = float(batch["attention_mask"].sum())
    routed = stats[1:-1].view(2, 8)
    assert float(stats[0]) == tokens and routed.sum(1).tolist() == [2 * tokens] * 2
    ratio = (routed.max(1).values / routed.mean(1)).tolist()
    rows = [split_step(tmp_path, "qwen3_moe", micro, f"moe.aux_loss_coef={COEF}")[1] for micro in (4, 1)]
    for row in rows:
        assert row["moe/load_max_over_mean"] == pytest.approx(max(ratio), rel=1e-6)
        assert row["moe/load_max_over_mean_avg"] == pytest.approx(sum(ratio) / 2, rel=1e-6)
        assert row["moe/router_entropy"] == pytest.approx(float(stats[-1]) / (2 * tokens), rel=1e-6)
    assert 1.0 < max(ratio) < 4.0  # some imbalance, not all tokens on 2 experts


def test_banner_says_experts_and_active_parameters():
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.model.moe import experts_line

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**FAMILIES["qwen3_moe"]))
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert expert == 2 * 8 * 32 * 32 * 3  # layers x experts x (gate_up 2 x 32 x 32 + down 32 x 32)
    active = total - expert + expert // 4
    line = experts_line(model)
    assert line == f"experts 8, active 2 per token, parameters {total / 1e3:.1f}K total / {active / 1e3:.1f}K active"
    assert experts_line(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type="llama", **SHAPE))) is None


# --- refusals ---------------------------------------------------------------------------------------


def _refusal(tmp_path, config: dict, *overrides: str) -> str:
    from llmft.errors import UserError

    with pytest.raises(UserError) as err:
        plan_for(tmp_path, config, 2, *overrides)
    return str(err.value)


def test_moe_keys_on_a_dense_model_are_refused(tmp_path):
    dense = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if k != "num_experts_per_tok"}}
    text = _refusal(tmp_path, dense, "moe.aux_loss_coef=0.1", "moe.balance=micro_batch")
    assert (
        "moe.aux_loss_coef: is set, but the model ('llama') is dense: it has no experts and no router, so "
        "there is no routing for moe.* to act on. Remove moe.aux_loss_coef from the recipe (moe.* applies to "
        "mixture-of-experts models only, docs/moe.md)."
    ) in text
    assert "moe.balance: is set, but the model ('llama') is dense" in text


def test_an_unknown_moe_family_is_refused_with_how_to_describe_it(tmp_path):
    config = {"model_type": "jamba", "num_experts": 4, **SHAPE}
    text = _refusal(tmp_path, config)
    assert (
        "model.config: model_type 'jamba' looks like a mixture of experts (num_experts: 4) but llmft has no "
        "description of its routing"
    ) in text
    assert (
        "Describe the family in the module train.objective_module names: llmft.plan.moe.register_moe_family("
        "MoEFamily('jamba', experts='num_experts', top_k='num_experts_per_tok', aux_coef='router_aux_loss_coef'))"
    ) in text


def test_a_z_loss_on_a_family_without_one_is_refused(tmp_path):
    text = _refusal(tmp_path, FAMILIES["qwen3_moe"], "moe.z_loss_coef=0.001")
    assert text.endswith(
        "moe.z_loss_coef: qwen3_moe defines no router z-loss in transformers (only the load-balancing loss, "
        "moe.aux_loss_coef), so there is none to weigh. Remove moe.z_loss_coef from the recipe (or set it to 0)."
    )
    assert "moe.z_loss_coef" not in _refusal(tmp_path / "neg", FAMILIES["qwen3_moe"], "moe.aux_loss_coef=-1")


def trained_load(tmp_path, coef: float, steps: int = 20) -> float:
    """max / mean tokens per expert (the worst layer) over the 4 examples after ``steps`` AdamW steps
    on them with the balancing loss weighted ``coef``."""
    from test_aux_loss import _engine

    from llmft.job.dist import DistEnv
    from llmft.model.moe import routing_sums
    from llmft.objectives import build_objective
    from llmft.stop import StopRequest
    from llmft.training.loop import LoopConfig, LoopHooks, LoopState, train_loop
    from llmft.training.optim import build_scheduler

    extra = ("optim.name=adamw", "optim.lr=0.01", f"moe.aux_loss_coef={coef}")
    plan = plan_for(tmp_path / f"coef-{coef}", FAMILIES["qwen3_moe"], GLOBAL, *extra)
    engine = _engine(plan)
    batch = collate(examples(), 0)
    hooks = LoopHooks(log_train=lambda row: None, evaluate=lambda s: None, checkpoint=lambda s: None)
    scheduler = build_scheduler(engine.optimizer, plan.recipe.optim, steps)
    args = (engine, build_objective(plan, engine), scheduler, iter([batch] * steps), plan.batch, DistEnv())
    train_loop(*args, LoopConfig(max_steps=steps), LoopState(), hooks, StopRequest())
    with torch.no_grad():
        out = engine.unwrap()(**batch, use_cache=False, output_router_logits=True)
    routed = routing_sums(out.router_logits, batch["attention_mask"], 8, 2)[1:-1].view(2, 8)
    return float((routed.max(1).values / routed.mean(1)).max())


def test_the_balancing_loss_balances_the_experts(tmp_path):
    on, off = trained_load(tmp_path, 1.0), trained_load(tmp_path, 0.0)
    print(f"max/mean expert load after 20 steps: {on:.3f} with the loss, {off:.3f} without")
    assert on < off - 0.2


def _packed(rows: list[list[int]]) -> list[dict]:
    """Packed rows of the examples (each a few whole examples, positions restarting at each)."""
    exs = examples()
    out = []
    for row in rows:
        ids, labels, pos = [], [], []
        for i in row:
            ids += exs[i]["input_ids"]
            labels += exs[i]["labels"]
            pos += list(range(len(exs[i]["input_ids"])))
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def test_packed_rows_leave_their_padded_tail_out_and_any_split_is_the_big_batch(tmp_path):
    """Packed rows carry no attention mask (transformers must build the block mask from the
    positions); their ``token_mask`` marks the padded tail of a short row, which the balancing loss
    leaves out: micro 4 (rows padded to the longest) gives micro 1's gradients (no padding at all).
    Without the mask the tails would count, and the two would differ."""
    from llmft.job.dist import DistEnv
    from llmft.model.moe import token_mask

    rows = _packed([[0, 1], [2], [3], [0, 2]])  # 22, 9, 26 and 14 tokens
    big = collate(rows, 0)
    assert "attention_mask" not in big and token_mask(big).sum() == 22 + 9 + 26 + 14
    results = {}
    for micro in (4, 1):
        plan = plan_for(tmp_path / f"packed-{micro}", FAMILIES["qwen3_moe"], micro, f"moe.aux_loss_coef={COEF}")
        results[micro] = loop_step(plan, DistEnv(), [collate(rows[i : i + micro], 0) for i in range(0, 4, micro)])
    assert max_abs_diff(results[4][0], results[1][0]) <= TOL
    assert results[4][1]["aux/moe_balance"] == pytest.approx(results[1][1]["aux/moe_balance"], rel=TOL)
    # the control: the tails counted (as with no mask) is another loss
    plan = plan_for(tmp_path / "tails", FAMILIES["qwen3_moe"], 4, f"moe.aux_loss_coef={COEF}")
    unmasked = {k: v for k, v in big.items() if k != "token_mask"}
    _, row = loop_step(plan, DistEnv(), [unmasked])
    assert abs(row["aux/moe_balance"] - results[1][1]["aux/moe_balance"]) > 1e-5
