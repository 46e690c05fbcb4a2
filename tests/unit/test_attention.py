"""``model.attn_implementation`` varlen_sdpa and auto (llmft/model/attention.py), on CPU in fp32:

- packed rows under varlen_sdpa give the unpacked rows' loss and gradients (sdpa, one example per
  row) to 1e-5, through the pre-hook's boundaries and without it;
- no tensor of seq^2 elements, forward or backward: the largest tensor any op makes grows linearly
  from 1K to 4K tokens, where sdpa's (the control, which keeps packed rows apart with a T x T mask)
  grows with the square, so the count can fail;
- ``auto`` resolves to flash_attention_2 / varlen_sdpa / sdpa as documented; a run with it trains
  like one with sdpa (SFT packed rows, padding-free DPO pairs, compiled layers); flex_attention on
  a machine without CUDA or a torch without it is refused before loading;
- the planner counts sdpa's packed-row mask and nothing for varlen_sdpa.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import max_rel_diff, metrics, packed_and_plain, tiny_llama_model, train_inproc, write_recipe
from torch.utils._python_dispatch import TorchDispatchMode

from llmft.data import count_targets
from llmft.errors import UserError
from llmft.model import attention, kernels
from llmft.plan.kernels import VARLEN_SDPA, chosen_attention
from llmft.plan.memory import estimate, packed_mask_bytes
from llmft.plan.resolve import load_plan


def varlen_model(**overrides):
    attention.register()
    return tiny_llama_model(VARLEN_SDPA, **overrides).train()


def loss_and_grads(model, batch: dict, n: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, num_items_in_batch=n, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("hook", [True, False], ids=["boundaries-hook", "from-position-ids"])
def test_packed_rows_give_the_unpacked_loss_and_gradients(hook):
    packed, plain = packed_and_plain()
    n = torch.tensor(float(count_targets(plain["labels"])))
    assert count_targets(packed["labels"]) == int(n)
    want_loss, want = loss_and_grads(tiny_llama_model("sdpa").train(), plain, n)

    model = varlen_model()
    if hook:
        kernels.pass_packed_boundaries(model)
    got_loss, got = loss_and_grads(model, packed, n)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert max_rel_diff(got, want) < 1e-5
    # the proof can fail: the same rows with plain 0..T-1 positions attend across examples
    leaky = dict(packed, position_ids=torch.arange(16).expand_as(packed["input_ids"]))
    assert abs(loss_and_grads(model, leaky, n)[0] - want_loss) > 1e-3


def test_padded_rows_take_sdpas_masked_path():
    """Unpacked, right-padded rows (an attention mask): varlen_sdpa computes sdpa's logits."""
    _, plain = packed_and_plain()
    inputs = {k: v for k, v in plain.items() if k != "labels"}
    with torch.no_grad():
        want = tiny_llama_model("sdpa")(**inputs, use_cache=False).logits
        got = varlen_model().eval()(**inputs, use_cache=False).logits
    keep = plain["attention_mask"].bool()
    assert torch.allclose(got[keep], want[keep], rtol=0, atol=1e-5)


def test_generation_with_a_cache_gives_sdpas_tokens():
    """Eval's generation (left-padded prompts, a KV cache): the masked and the cached calls take
    sdpa's own path, so varlen_sdpa decodes sdpa's tokens."""
    prompts = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    out = {}
    for attn, model in (("sdpa", tiny_llama_model("sdpa")), (VARLEN_SDPA, varlen_model().eval())):
        with torch.no_grad():
            padded = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=6, do_sample=False)
            # one row, no mask: the prefill is one example under varlen_sdpa, the cached steps sdpa's
            alone = model.generate(input_ids=prompts[1:], max_new_tokens=6, do_sample=False)
        out[attn] = (padded, alone)
    assert all(torch.equal(a, b) for a, b in zip(out[VARLEN_SDPA], out["sdpa"], strict=True))


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output holds while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor(attn: str, seq: int) -> int:
    """Forward and backward of one packed row of ``seq`` tokens (4 examples) through a 1-layer model."""
    small = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    model = (varlen_model if attn == VARLEN_SDPA else tiny_llama_model)(
        **small, num_key_value_heads=1, vocab_size=64, max_position_embeddings=seq
    ).train()
    kernels.pass_packed_boundaries(model)  # what the loop installs for varlen attention
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq // 4).repeat(4)[None]
    with LargestTensor() as mode:
        model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    return mode.numel


def test_memory_grows_linearly_with_the_row_length():
    seqs = (1024, 2048, 4096)
    varlen = [largest_tensor(VARLEN_SDPA, s) for s in seqs]
    assert all(n < s * s // 8 for n, s in zip(varlen, seqs, strict=True)), varlen  # no seq^2 tensor
    assert varlen[2] / varlen[0] <= 4.5, varlen  # 4x the tokens: linear is 4, quadratic 16
    # the control: sdpa's block-diagonal mask of a packed row is seq^2 elements
    sdpa = [largest_tensor("sdpa", s) for s in (1024, 4096)]
    assert sdpa[1] >= 4096 * 4096 and sdpa[1] / sdpa[0] >= 12, sdpa


def test_auto_picks_flash_then_varlen_for_packed_rows_then_sdpa():
    assert chosen_attention("auto", packing=True, flash=True) == "flash_attention_2"
    assert chosen_attention("auto", packing=True, flash=False) == VARLEN_SDPA
    assert chosen_attention("auto", packing=False, flash=False) == "sdpa"
    for name in ("sdpa", "eager", "flex_attention", "flash_attention_2", VARLEN_SDPA):
        assert chosen_attention(name, packing=True, flash=False) == name  # explicit values stay
    assert not torch.cuda.is_available()  # this machine: auto is varlen_sdpa for packed rows
    assert attention.choose("auto", packing=True) == VARLEN_SDPA
    assert attention.choose("auto", packing=False) == "sdpa"


def test_flex_attention_is_refused_without_cuda(tmp_path):
    recipe = write_recipe(tmp_path, model__attn_implementation="flex_attention", data__packing=True)
    with pytest.raises(UserError) as e:
        train_inproc(recipe)
    msg = str(e.value)
    assert "model.attn_implementation" in msg and "no FlexAttention backward on CPU" in msg
    assert "Set model.attn_implementation=auto" in msg


def test_flex_attention_is_refused_on_a_torch_without_it(monkeypatch):
    import sys

    from llmft.recipe.schema import ModelConfig

    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # its import fails
    with pytest.raises(UserError) as e:
        kernels.check_available(ModelConfig(attn_implementation="flex_attention"))
    msg = str(e.value)
    assert f"is flex_attention, but this torch ({torch.__version__}) has no FlexAttention" in msg
    assert "Set model.attn_implementation=auto" in msg


def test_a_packed_run_with_auto_trains_like_sdpa(tmp_path):
    """auto resolves to varlen_sdpa here: the same losses and weights as sdpa's masked rows (fp32)."""
    from helpers import checkpoint_weights

    runs = {}
    for attn in ("sdpa", "auto"):
        recipe = write_recipe(tmp_path / attn, model__attn_implementation=attn, data__packing=True)
        assert train_inproc(recipe, "train.max_steps=2", "checkpoint.every_steps=2") == 0
        run = tmp_path / attn / "run"
        runs[attn] = ([r["loss"] for r in metrics(run)], checkpoint_weights(run / "checkpoints/step-2"))
    assert runs["auto"][0] == pytest.approx(runs["sdpa"][0], rel=1e-5)
    assert max_rel_diff(runs["auto"][1], runs["sdpa"][1]) < 1e-5


def test_the_planner_counts_sdpas_packed_mask_and_none_for_varlen(tmp_path):
    recipe = write_recipe(tmp_path, model__attn_implementation="sdpa", data__packing=True, data__max_seq_len=4096)
    plan = load_plan(recipe, ["batch.micro_batch_size=2", "batch.global_batch_size=2"])
    r = plan.recipe
    sdpa = estimate(r, "single", 1, 2, 1)
    varlen = estimate(
        dataclasses.replace(r, model=dataclasses.replace(r.model, attn_implementation="auto")), "single", 1, 2, 1
    )
    assert packed_mask_bytes(r, 2 * 4096) == 2 * 4096 * 4096
    assert sdpa.activations - varlen.activations == 2 * 4096 * 4096
    unpacked = dataclasses.replace(r, data=dataclasses.replace(r.data, packing=False))
    assert packed_mask_bytes(unpacked, 2 * 4096) == 0
    # from 64 MiB of mask (one 8K row) the plan says so, and what needs none
    assert not any("T x T mask" in n for n in sdpa.notes)
    long = dataclasses.replace(r, data=dataclasses.replace(r.data, max_seq_len=8192))
    (note,) = [n for n in estimate(long, "single", 1, 1, 1).notes if "T x T mask" in n]
    assert note.startswith("sdpa keeps packed rows apart with a T x T mask per row (0.06 GiB")
    assert "model.attn_implementation=auto" in note


@pytest.mark.slow  # two runs, one compiling its layers: ~50 s on 2 cores
def test_compiled_layers_run_varlen_sdpa_eagerly_with_the_same_training(tmp_path):
    from helpers import checkpoint_weights
    from torch._dynamo.utils import counters

    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        counters.clear()
        recipe = write_recipe(
            tmp_path / name, model__attn_implementation="auto", model__compile=compiled, data__packing=True
        )
        assert train_inproc(recipe, "train.max_steps=3", "checkpoint.every_steps=3") == 0
        run = tmp_path / name / "run"
        runs[name] = ([r["loss"] for r in metrics(run)], checkpoint_weights(run / "checkpoints/step-3"))
    # the attention is a graph break inside each compiled layer (torch.compiler.disable), not recompiled
    assert any("varlen_sdpa_forward" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0
    assert runs["compiled"][0] == pytest.approx(runs["eager"][0], rel=1e-5)
    assert max_rel_diff(runs["compiled"][1], runs["eager"][1]) < 1e-5


@pytest.mark.slow  # two dpo runs of 4 steps with eval: ~25 s on 2 cores
def test_padding_free_dpo_with_auto_trains_like_sdpa(tmp_path):
    """Preference pairs packed padding-free (data.packing): auto (varlen_sdpa) gives sdpa's run:
    losses, rewards and log-probs, train and eval, and the final weights, to 1e-5."""
    from preference_runs import assert_same_run, dpo_recipe

    for attn in ("sdpa", "auto"):
        recipe = dpo_recipe(tmp_path / attn, model__attn_implementation=attn, data__packing=True, peft__method="lora")
        assert train_inproc(recipe) == 0
    assert_same_run(tmp_path / "auto", tmp_path / "sdpa", tol=1e-5)


@pytest.mark.parametrize("packing", [True, False])
def test_exports_base_model_resolves_auto_as_the_build_does(tmp_path, packing):
    from llmft.model.build import load_base_model

    recipe = write_recipe(tmp_path, model__attn_implementation="auto", data__packing=packing)
    model = load_base_model(load_plan(recipe, []).recipe)
    assert model.config._attn_implementation == (VARLEN_SDPA if packing else "sdpa")
