"""Speed switches on CPU (llmft/model/kernels.py, llmft/plan/kernels.py, llmft/training/optim.py): each one computes what the torch path
computes, and what cannot run here is refused with a message that names the key.

- packed rows under a varlen attention kernel: the boundaries llmft passes (``cu_seq_lens``) give
  the unpacked loss for a micro-batch of several rows, where transformers' own inference (one row
  only) would attend across examples. A CPU reference of the varlen kernel stands in for
  FlashAttention; tests/gpu/test_gpu.py runs the real one.
- ``model.compile``: regional compilation gives eager's losses and weights (fp32, 1e-5 relative),
  also with LoRA and gradient checkpointing.
- fused AdamW (chosen on CUDA) makes the same update as the default implementation.
- ``model.liger_kernels`` without CUDA: a UserError before the model is built; with ``model.compile``
  too, one path per module (compiled layers, Liger's fused loss) and the banner line saying so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_LLAMA, max_rel_diff, metrics, packed_and_plain, train_inproc, write_recipe

from llmft.data import count_targets
from llmft.data.encode import IGNORE_INDEX
from llmft.errors import UserError
from llmft.model import kernels
from llmft.plan.resolve import load_plan
from llmft.recipe import RecipeError

VARLEN = "llmft_test_varlen"


# --- packed rows: boundaries for varlen attention ------------------------------------------------


def test_varlen_kwargs_mark_every_restart_and_every_row():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 0, 1]])
    got = kernels.varlen_kwargs(positions)
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 14, 16, 18]
    assert got["cu_seq_lens_q"].dtype == torch.int32
    assert got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["max_length_q"] == got["max_length_k"] == 5
    # rows that do not restart are one sequence each: rows never merge
    plain = kernels.varlen_kwargs(torch.arange(6).expand(3, 6))
    assert plain["cu_seq_lens_q"].tolist() == [0, 6, 12, 18] and plain["max_length_q"] == 6


def test_boundaries_only_for_packed_training_calls():
    pos = torch.tensor([[0, 1, 0, 1]])
    assert kernels._add_boundaries(None, (), {"position_ids": pos, "attention_mask": torch.ones(1, 4)}) is None
    assert kernels._add_boundaries(None, (), {"position_ids": pos, "past_key_values": object()}) is None
    assert kernels._add_boundaries(None, (), {"position_ids": None}) is None
    _, kwargs = kernels._add_boundaries(None, (), {"position_ids": pos, "use_cache": False})
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 2, 4] and kwargs["use_cache"] is False


def _reference_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What transformers' flash-attention path computes, in plain torch on CPU: with ``cu_seq_lens``
    (its "padding-free" varlen branch) causal attention inside each sequence of the flattened rows;
    without them and with several rows, causal attention over each whole row."""
    rows, heads, seq, dim = query.shape
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    q, k, v = (t.transpose(1, 2).reshape(rows * seq, heads, dim) for t in (query, key, value))
    pieces = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling).transpose(0, 1))
    return torch.cat(pieces).reshape(rows, seq, heads, dim), None


@pytest.fixture
def varlen_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(VARLEN, _reference_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)  # FA2's mask: None when unpadded
    yield VARLEN


def tiny_llama(attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**TINY_LLAMA)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval()


def token_losses(model, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"][:, 1:].flatten()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return losses[labels != IGNORE_INDEX].sort().values


def test_varlen_attention_with_boundaries_gives_the_unpacked_loss(varlen_attention):
    from peft import LoraConfig, get_peft_model

    packed, plain = packed_and_plain()
    want = token_losses(tiny_llama("eager"), plain)

    model = tiny_llama(varlen_attention)
    leaky = token_losses(model, packed)  # no boundaries, several rows: attention crosses examples
    assert (leaky.sum() - want.sum()).abs() > 1e-2

    # Through PEFT, as the loop calls it: the hook sits on the decoder inside the wrapper.
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    kernels.pass_packed_boundaries(kernels.causal_lm(peft))
    kernels.pass_packed_boundaries(kernels.causal_lm(peft))  # idempotent: one hook
    got = token_losses(peft, packed)
    assert len(got) == len(want) == count_targets(plain["labels"])
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    n = torch.tensor(float(count_targets(plain["labels"])))
    with torch.no_grad():
        loss = peft(**packed, num_items_in_batch=n, use_cache=False).loss
    assert abs(float(loss) - float(want.sum() / n)) < 1e-5


@pytest.mark.slow  # flex_attention compiles its kernel on CPU: ~40 s
def test_flex_attention_packed_loss_equals_unpacked_loss():
    packed, plain = packed_and_plain()
    want = token_losses(tiny_llama("eager"), plain)
    got = token_losses(tiny_llama("flex_attention"), packed)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


# --- model.compile --------------------------------------------------------------------------------

COMPILED = dict(data__packing=True, train__max_steps=3, model__attn_implementation="sdpa")


def _run(tmp_path, name: str, **overrides) -> tuple[list[dict], dict]:
    from helpers import checkpoint_weights

    recipe = write_recipe(tmp_path / name, **COMPILED, **overrides)
    assert train_inproc(recipe, "checkpoint.every_steps=3") == 0
    return metrics(tmp_path / name / "run"), checkpoint_weights(tmp_path / name / "run/checkpoints/step-3")


def _assert_same_training(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    (rows_a, weights_a), (rows_b, weights_b) = a, b
    assert len(rows_a) == len(rows_b) == 3
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    assert max_rel_diff(weights_a, weights_b) < 1e-5


def test_compile_gives_eager_losses_and_weights(tmp_path):
    """Full fine-tune, fp32, 3 steps: losses to 1e-5 relative, final weights to 1e-5 (relative norm)."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = _run(tmp_path, "compiled", model__compile=True)
    assert counters["stats"]["calls_captured"] > 0  # the layers really ran compiled
    _assert_same_training(compiled, _run(tmp_path, "eager"))


@pytest.mark.slow  # a second compilation (LoRA layers, checkpointed backward): ~30 s
def test_compile_composes_with_lora_and_gradient_checkpointing(tmp_path):
    extra = dict(peft__method="lora", peft__r=4, model__gradient_checkpointing=True)
    _assert_same_training(_run(tmp_path, "compiled", model__compile=True, **extra), _run(tmp_path, "eager", **extra))


def test_compile_wraps_each_decoder_layer_and_keeps_names(tmp_path):
    import dataclasses

    from llmft.data.tokenizer import load_tokenizer
    from llmft.model.build import prepare_model
    from llmft.plan.resolve import load_plan

    plan = load_plan(str(write_recipe(tmp_path, peft__method="lora", model__compile=True)), [])
    recipe = plan.recipe
    tok = load_tokenizer(recipe.model)
    model = prepare_model(plan, tok, torch.device("cpu"))
    layers = kernels.causal_lm(model).model.layers
    assert len(layers) == TINY_LLAMA["num_hidden_layers"]
    assert all(layer._compiled_call_impl is not None for layer in layers)
    off = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, compile=False))
    eager = prepare_model(dataclasses.replace(plan, recipe=off), tok, torch.device("cpu"))
    assert list(model.state_dict()) == list(eager.state_dict())  # checkpoints do not see compile
    assert kernels.causal_lm(model).model._compiled_call_impl is None  # only the layers


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, where, what",
    [
        (
            ["model.compile=true", "distributed.engine=deepspeed", "distributed.nproc_per_node=2"],
            "model.compile",
            "not supported with distributed.engine=deepspeed",
        ),
        (
            ["model.liger_kernels=true", "distributed.engine=deepspeed", "distributed.zero_stage=3"],
            "model.liger_kernels",
            "cannot run under DeepSpeed ZeRO-3",
        ),
        (
            ["model.liger_kernels=true", "peft.method=lora", "peft.target_modules=[q_proj,lm_head]"],
            "model.liger_kernels",
            "LoRA adapter on lm_head",
        ),
    ],
)
def test_impossible_combinations_are_refused_at_load(tmp_path, overrides, where, what):
    with pytest.raises(RecipeError) as e:
        load_plan(str(write_recipe(tmp_path)), overrides)
    assert any(p.where.endswith(where) and what in p.what for p in e.value.problems), str(e.value)


def test_possible_combinations_load(tmp_path):
    plan = load_plan(
        str(write_recipe(tmp_path)),
        ["model.compile=true", "model.liger_kernels=true", "peft.method=lora", "peft.modules_to_save=[lm_head]"],
    )
    assert plan.recipe.model.compile and plan.recipe.model.liger_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_liger_without_cuda_fails_before_the_model_is_built(tmp_path, monkeypatch):
    import llmft.model.build

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the check")

    monkeypatch.setattr(llmft.model.build, "build_model", never)
    with pytest.raises(UserError) as e:
        train_inproc(write_recipe(tmp_path, model__liger_kernels=True))
    assert str(e.value).startswith("model.liger_kernels: is true, but this machine has no CUDA GPU")
    assert "model.liger_kernels=false" in str(e.value)


def test_liger_not_installed_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # import fails as if absent
    with pytest.raises(UserError) as e:
        kernels._check_liger()
    assert str(e.value).startswith("model.liger_kernels: is true, but liger-kernel cannot be imported")
    assert ".[liger]" in str(e.value)


# --- model.compile with model.liger_kernels: one path per module ---------------------------------


@pytest.mark.parametrize(
    "compile_, liger, paths, line",
    [
        (False, False, (False, False, False), None),
        (
            True,
            False,
            (True, False, False),
            "kernel paths: decoder layers compiled by torch.compile (transformers' RMSNorm, RoPE, SwiGLU fused by "
            "inductor); loss: transformers' head and cross-entropy",
        ),
        (
            False,
            True,
            (False, True, True),
            "kernel paths: decoder layers eager with Liger's RMSNorm, RoPE and SwiGLU; loss: Liger's fused linear "
            "cross-entropy, eager",
        ),
        (
            True,
            True,
            (True, False, True),
            "kernel paths: decoder layers compiled by torch.compile (transformers' RMSNorm, RoPE, SwiGLU fused by "
            "inductor; Liger's are left out of the compiled layers); loss: Liger's fused linear cross-entropy, eager",
        ),
    ],
)
def test_compile_and_liger_pick_one_path_per_module(tmp_path, compile_, liger, paths, line):
    """Liger's Triton RMSNorm does not compile inside inductor: with both switches the layers are
    compiled without Liger's layer kernels, and Liger keeps the loss (outside the compiled layers)."""
    from llmft.plan.kernels import kernel_paths, kernel_paths_line

    m = load_plan(str(write_recipe(tmp_path, model__compile=compile_, model__liger_kernels=liger)), []).recipe.model
    got = kernel_paths(m)
    assert (got.compiled_layers, got.liger_layers, got.liger_loss) == paths
    assert kernel_paths_line(m) == line
    from types import SimpleNamespace

    from llmft.job.dist import DistEnv
    from llmft.training.report import banner

    plan = load_plan(str(tmp_path / "recipe.yaml"), [])
    engine, data = SimpleNamespace(unwrap=lambda: torch.nn.Linear(2, 2)), SimpleNamespace(train=range(9), num_rows=9)
    text = banner(plan, DistEnv(), 3, engine, data)
    assert (line in text.splitlines()) if line else "kernel paths" not in text  # the start banner's line


@pytest.mark.parametrize("compile_", [False, True])
def test_liger_is_asked_for_the_layer_kernels_only_where_layers_are_not_compiled(tmp_path, monkeypatch, compile_):
    """What ``kernels.apply`` hands Liger's patcher (a recorder stands in for liger-kernel, which
    needs CUDA): its RMSNorm, RoPE and SwiGLU only on eager layers, its fused loss always; with
    compile on every decoder layer is compiled and none is given to Liger."""
    import sys
    import types

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.model.build import build_model

    asked: list[dict] = []
    patcher = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patcher.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None}
    patcher._apply_liger_kernel_to_instance = lambda **kw: asked.append({k: v for k, v in kw.items() if k != "model"})
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patcher)
    plan = load_plan(str(write_recipe(tmp_path, model__compile=compile_, model__liger_kernels=True)), [])
    model = build_model(plan.recipe, byte_tokenizer())
    kernels.apply(model, plan.recipe.model)
    layers = not compile_
    assert asked == [
        dict(rope=layers, rms_norm=layers, swiglu=layers, cross_entropy=False, fused_linear_cross_entropy=True)
    ]
    compiled = [layer._compiled_call_impl is not None for layer in kernels.causal_lm(model).model.layers]
    assert compiled == [compile_] * TINY_LLAMA["num_hidden_layers"]


# --- fused AdamW ----------------------------------------------------------------------------------


def test_fused_adamw_only_on_cuda_and_same_update():
    from llmft.training.optim import adamw_implementation

    cpu = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    assert adamw_implementation(cpu) == {"foreach": None}  # CPU runs keep their numerics
    # torch's fused kernel (here its CPU build, the same algorithm as on CUDA) makes the same update
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (16, 8)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(5)]
    results = []
    for impl in ({"foreach": None}, {"fused": True}):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(
            [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
            lr=1e-2,
            **impl,
        )
        for g in grads:
            for p, gi in zip(params, g, strict=True):
                p.grad = gi.clone()
            opt.step()
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
