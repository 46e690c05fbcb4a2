"""LoRA on the fused expert weights of a mixture of experts (``peft.target_experts``, PEFT's
``target_parameters``) and the router trained in full (``peft.train_router``): llmft/model/adapters.py,
docs/moe.md.

Tiny fp32 MoE models (2 layers, 8 experts, top-2, from tests/unit/test_moe.py) built from
``model.config``: the expert LoRA weights get gradients and the router none unless asked; the
trainable count grows by exactly the experts' LoRA; ``llmft train`` and ``llmft export`` give an adapter
that PEFT loads and a merged model that transformers loads, both with the trained model's logits;
and the refusals say what, where and how to fix.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import write_recipe
from test_moe import FAMILIES, plan_for

TOL = 1e-5
R = 4


def build(tmp_path, family: str, *overrides: str):
    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import build_model

    plan = plan_for(tmp_path, FAMILIES[family], 4, "peft.method=lora", f"peft.r={R}", "peft.alpha=8", *overrides)
    return build_model(plan.recipe, byte_tokenizer())


def expert_lora_count(config: dict) -> int:
    """The LoRA weights of every MoE layer's two fused weights: per weight, A (r x experts, in) and
    B (out, r x experts)."""
    e, h = config.get("num_experts") or config["num_local_experts"], config["hidden_size"]
    ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    gate_up = R * e * (h + 2 * ffn)
    down = R * e * (ffn + h)
    return config["num_hidden_layers"] * (gate_up + down)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_lora_on_the_experts_trains_them_and_not_the_router(tmp_path, family):
    from llmft.model.structure import param_counts

    model = build(tmp_path / "on", family)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    params = dict(model.named_parameters())
    expert_b = [n for n in params if ".experts." in n and "lora_B" in n]
    assert len(expert_b) == 2 * 2  # two fused weights in each of the two MoE layers
    # B starts at zero, so A has no gradient on the first step; B has one on every expert weight
    assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in expert_b)
    router = [n for n in params if ".router." in n or ".gate." in n]
    assert router and all(not params[n].requires_grad and params[n].grad is None for n in router)

    # The trainable-parameter line counts the experts' LoRA: exactly it on top of the other layers'.
    without = build(tmp_path / "off", family, "peft.target_experts=false")
    assert not [n for n, _ in without.named_parameters() if ".experts." in n and "lora_" in n]
    assert param_counts(model)[0] - param_counts(without)[0] == expert_lora_count(FAMILIES[family])


def test_train_router_trains_the_router_in_full_and_the_balancing_loss_still_sees_it(tmp_path):
    model = build(tmp_path, "qwen3_moe", "peft.train_router=true")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2  # transformers still records the wrapped router's logits
    (out.loss + out.aux_loss).backward()
    routers = {n: p for n, p in model.named_parameters() if ".mlp.gate." in n and p.requires_grad}
    assert sorted(routers) == [
        f"base_model.model.model.layers.{i}.mlp.gate.modules_to_save.default.weight" for i in range(2)
    ]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers.values())


def trained_reference(recipe, step_dir):
    """llmft's own model of the recipe with the checkpoint's trained weights copied in by name (not
    through PEFT's loading): the model training ended with."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from llmft.model.build import build_model

    model = build_model(recipe, AutoTokenizer.from_pretrained(step_dir / "tokenizer"))
    saved = load_file(step_dir / "model" / "adapter_model.safetensors")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    by_saved_name = {n.replace(".modules_to_save.default", "").replace(".default", ""): n for n in trainable}
    assert by_saved_name.keys() == saved.keys()
    with torch.no_grad():
        for key, value in saved.items():
            trainable[by_saved_name[key]].copy_(value)
    return model.eval(), saved


@torch.no_grad()
def logits(model, ids):
    return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize(("family", "train_router"), [("qwen3_moe", False), ("mixtral", True)])
def test_train_and_export_give_the_trained_logits_in_peft_and_transformers(tmp_path, family, train_router):
    from helpers import train_inproc
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmft.export.export import BASE_DIR, export_model_dir
    from llmft.recipe import load_recipe

    overrides = ["peft.method=lora", f"peft.r={R}", "peft.alpha=8", f"peft.train_router={str(train_router).lower()}"]
    recipe_path = write_recipe(tmp_path, model__config=FAMILIES[family], train__max_steps=2)
    assert train_inproc(recipe_path, "optim.lr=0.05", *overrides) == 0
    step_dir = tmp_path / "run" / "checkpoints" / "step-2"
    model, saved = trained_reference(load_recipe(recipe_path, ["optim.lr=0.05", *overrides]), step_dir)
    expert_b = [k for k in saved if ".experts." in k and "lora_B" in k]
    assert len(expert_b) == 4 and all(saved[k].abs().max() > 0 for k in expert_b)  # the experts trained
    assert any(".mlp.gate." in k for k in saved) == train_router

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    want = logits(model, ids)
    base = AutoModelForCausalLM.from_pretrained(step_dir.parent / BASE_DIR, attn_implementation="eager")
    assert (logits(base, ids) - want).abs().max() > 1e-3  # training moved the logits

    adapter = export_model_dir(step_dir, tmp_path / "adapter", merge_lora=False)
    base = AutoModelForCausalLM.from_pretrained(adapter / BASE_DIR, attn_implementation="eager")
    assert (logits(PeftModel.from_pretrained(base, adapter), ids) - want).abs().max() <= TOL

    merged_dir = export_model_dir(step_dir, tmp_path / "merged", merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager")
    assert (logits(merged, ids) - want).abs().max() <= TOL
    base_weights = load_file(step_dir.parent / BASE_DIR / "model.safetensors")
    merged_weights = {n: p for n, p in merged.named_parameters()}
    router = "model.layers.0.mlp.gate.weight"
    if train_router:
        assert torch.equal(merged_weights[router], saved[f"base_model.model.{router}"])
    else:
        assert torch.equal(merged_weights[router], base_weights[router])
    assert not torch.equal(
        merged_weights["model.layers.0.mlp.experts.down_proj"], base_weights["model.layers.0.mlp.experts.down_proj"]
    )


def test_qlora_packs_the_experts_in_4_bits_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmft")
    model = build(tmp_path, "qwen3_moe", "model.quantization={bits: 4}")
    types = {type(p).__name__ for n, p in model.named_parameters() if "self_attn.q_proj.base_layer" in n}
    assert types == {"Params4bit"}  # the linear layers are 4-bit
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.base_layer.base_layer.gate_up_proj")]
    assert len(experts) == 2 and all(type(p).__name__ == "Params4bit" for p in experts)  # so are the experts
    assert "experts: gate_up_proj, down_proj of 2 MoE layers in 4 bits (nf4, double quant)" in caplog.text
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    expert_b = [p for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(expert_b) == 4 and all(p.grad.abs().sum() > 0 for p in expert_b)


# --- refusals ---------------------------------------------------------------------------------------


def _refusal(tmp_path, config: dict, *overrides: str) -> str:
    from llmft.errors import UserError

    with pytest.raises(UserError) as err:
        plan_for(tmp_path, config, 2, *overrides)
    return str(err.value)


def test_target_experts_and_train_router_on_a_dense_model_are_refused(tmp_path):
    from test_moe import SHAPE

    dense = {"model_type": "llama", **{k: v for k, v in SHAPE.items() if k != "num_experts_per_tok"}}
    text = _refusal(tmp_path, dense, "peft.method=lora", "peft.target_experts=true", "peft.train_router=true")
    assert (
        "peft.target_experts: is true, but the model ('llama') is dense: it has no experts and no router. Remove "
        "peft.target_experts from the recipe (it applies to mixture-of-experts models only, docs/moe.md)."
    ) in text
    assert "peft.train_router: is true, but the model ('llama') is dense" in text
    # The default (null) is no request: a dense model trains with LoRA as before.
    plan_for(tmp_path / "ok", dense, 2, "peft.method=lora")


def test_what_lora_on_the_experts_cannot_do_is_refused(tmp_path):
    moe = FAMILIES["qwen3_moe"]
    assert (
        "peft.dropout: is 0.1, but LoRA on the fused expert weights of qwen3_moe (peft.target_experts, on by default "
        "for a mixture of experts) adds its update to the weight, so there is no input to drop. Set peft.dropout: "
        "0, or peft.target_experts: false to leave the experts out of LoRA."
    ) in _refusal(tmp_path / "dropout", moe, "peft.method=lora", "peft.dropout=0.1")
    plan_for(tmp_path / "no-experts", moe, 2, "peft.method=lora", "peft.dropout=0.1", "peft.target_experts=false")
    assert (
        "peft.target_experts: is true, but peft.method is dora: PEFT's LoRA on the fused expert weights has no DoRA "
        "variant. Set peft.method: lora, or peft.target_experts: false (DoRA on the other layers only)."
    ) in _refusal(tmp_path / "dora", moe, "peft.method=dora", "peft.target_experts=true")
    assert (
        "peft.train_router: is true, but peft.method is none: a full fine-tune trains the experts and the router "
        "already. Set peft.method: lora, or remove peft.train_router from the recipe."
    ) in _refusal(tmp_path / "full", moe, "peft.train_router=true")


@pytest.mark.parametrize("target_experts", [False, True])
def test_a_lora_policy_adds_the_balancing_loss_once_and_any_split_is_the_big_batch(tmp_path, target_experts):
    """Inside PEFT's wrapper transformers' own balancing loss is switched off on the causal-LM module
    itself (the wrapper forwards the attribute): ``loss`` is the task loss alone, as with the term
    off, and micro 1 x accumulation 4 lands on micro 4's gradients."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "distributed"))
    import test_moe_lora_ranks as T
    from preference_batches import preference_step
    from test_moe import max_abs_diff

    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    def run(micro: int, coef: float, steps: int):
        over = [*T.COMMON, *T._overrides("qwen3_moe"), f"peft.target_experts={str(target_experts).lower()}"]
        over += [f"moe.aux_loss_coef={coef}", f"batch.micro_batch_size={micro}", "distributed.engine=single"]
        plan = resolve(load_recipe(write_recipe(tmp_path / f"{micro}-{coef}-{steps}"), over))
        return preference_step(plan, DistEnv(), T._steps(micro)[: steps * (T.GLOBAL // micro)], steps=steps)

    _, off = run(4, 0.0, 1)
    _, on = run(4, 0.5, 1)
    assert on["loss"] == pytest.approx(off["loss"], abs=1e-6)  # the task loss alone
    assert on["aux/moe_balance"] > 0.1
    big, split = run(4, 0.5, 2)[0], run(1, 0.5, 2)[0]
    assert max_abs_diff(big, split) <= TOL


def test_activation_checkpointing_with_lora_on_the_experts_keeps_any_split_the_big_batch(tmp_path, monkeypatch):
    """Activation checkpointing recomputes each MoE layer (LoRA on its fused weights, the trained
    router) in backward: micro 1 x accumulation 4 with it gives micro 4's gradients without it, the
    balancing loss on, after two SGD steps."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "distributed"))
    import test_moe_lora_ranks as T
    from preference_batches import preference_step
    from test_moe import max_abs_diff
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from llmft.job.dist import DistEnv
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    calls = []
    forward = Qwen3MoeExperts.forward
    monkeypatch.setattr(Qwen3MoeExperts, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))

    def run(micro: int, checkpointing: bool):
        over = [*T.COMMON, *T._overrides("qwen3_moe"), "peft.train_router=true", f"batch.micro_batch_size={micro}"]
        over += [f"model.gradient_checkpointing={str(checkpointing).lower()}", "distributed.engine=single"]
        plan = resolve(load_recipe(write_recipe(tmp_path / f"{micro}-{checkpointing}"), over))
        calls.clear()
        grads, row = preference_step(plan, DistEnv(), T._steps(micro), steps=T.STEPS)
        return grads, row, len(calls)

    big, big_row, big_calls = run(4, checkpointing=False)
    split, split_row, split_calls = run(1, checkpointing=True)
    # each micro-batch's MoE layers run in the routing pre-pass, the forward and (checkpointed) again in backward
    assert (big_calls, split_calls) == (T.STEPS * 2 * 2, T.STEPS * 4 * 2 * 3)
    assert [n for n in big if ".experts." in n and "lora_B" in n] and [n for n in big if ".mlp.gate." in n]
    assert max_abs_diff(big, split) <= TOL, max_abs_diff(big, split)
    assert split_row["aux/moe_balance"] == pytest.approx(big_row["aux/moe_balance"], rel=TOL)
    assert split_row["loss"] == pytest.approx(big_row["loss"], rel=TOL)
