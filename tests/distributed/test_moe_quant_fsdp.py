"""QLoRA's 4-bit experts under FSDP2 (llmft/model/moe_quant.py; docs/moe.md): 2 processes on gloo under
torchrun, each with 2 of the 4 examples of every step (micro 1 x accumulation 2), give after two SGD
steps the LoRA gradients (the experts' and the attention's) and the logged loss of one process with the
whole batch, while every rank holds about half of each packed fused expert weight in 4 bits.

Two builds: a fresh ``model.config`` model (quantized whole on every rank, then sharded), and a
pretrained one whose checkpoint stores the experts per expert (built on the meta device; each rank
quantizes only the blocks of its part of the packed bytes), whose gathered bytes and statistics equal
one process quantizing the whole model, to the bit. ``llmft train`` + ``llmft export`` of such a run
gives an adapter that PEFT loads on the exported base with the logits of the trained model.

This file is also the probe that torchrun runs on each rank: ``python test_moe_quant_fsdp.py RECIPE
OUT_FILE VARIANTS_JSON [KEY=VALUE ...]``; rank 0 writes {variant: {"grads", "row", "packed", "local"}}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, the step harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the examples and the tiny families

from helpers import ROOT, torchrun, write_recipe  # noqa: E402
from preference_batches import preference_step  # noqa: E402
from test_aux_loss import GLOBAL  # noqa: E402
from test_moe import FAMILIES, max_abs_diff  # noqa: E402
from test_moe_ranks import STEPS, _steps, launch  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# One expert a whole number of 64-weight blocks, and every last dimension a multiple of 64 (bitsandbytes
# 0.50's CPU dequantize_4bit misreads others when the saved base is dequantized whole: test_moe_quant.py).
CONFIG = {**FAMILIES["qwen3_moe"], "hidden_size": 64, "head_dim": 16, "moe_intermediate_size": 64}
QLORA = ["model.quantization={bits: 4}", "peft.method=lora", "peft.r=4", "peft.alpha=8"]
COMMON = [f"batch.global_batch_size={GLOBAL}", "optim.name=sgd", "optim.lr=0.5", "optim.max_grad_norm=null", *QLORA]
FUSED = ("gate_up_proj", "down_proj")


def _variant_overrides(variant: str, pretrained: str) -> list[str]:
    if variant == "fresh":
        return [f"model.config={json.dumps(CONFIG)}"]
    return [f"model.name_or_path={pretrained}", "model.config=null"]


def save_pretrained(directory: Path) -> Path:
    """A tiny qwen3_moe saved by transformers (its experts stored per expert)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), dtype=torch.float32)
    model.save_pretrained(directory)
    from llmft.data.tokenizer import byte_tokenizer

    byte_tokenizer().save_pretrained(directory)
    return directory


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "llmft_quant")]


def _state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset.reshape(1), state.state2.absmax, state.state2.code]
    return [t.detach().float().cpu().clone() for t in tensors]


def packed_bytes(model: torch.nn.Module) -> dict[str, dict]:
    """Every fused expert weight's packed bytes (gathered whole where sharded) and its statistics."""
    out = {}
    for where, module in experts_modules(model):
        for name in FUSED:
            p = getattr(module, name)
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p.data
            out[f"{where}.{name}"] = {
                "bytes": whole.detach().contiguous().view(torch.uint8).reshape(-1).cpu().clone(),
                "state": _state_tensors(module.llmft_quant[name]),
            }
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return save_pretrained(tmp_path_factory.mktemp("pretrained") / "model")


def _one_process(tmp: Path, variant: str, pretrained: Path):
    from llmft.data.tokenizer import load_tokenizer
    from llmft.job.dist import DistEnv
    from llmft.model.build import build_model
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    over = [*COMMON, *_variant_overrides(variant, str(pretrained))]
    over += [f"batch.micro_batch_size={GLOBAL}", "distributed.engine=single"]
    plan = resolve(load_recipe(write_recipe(tmp), over))
    grads, row = preference_step(plan, DistEnv(), _steps(GLOBAL), steps=STEPS)
    model = build_model(plan.recipe, load_tokenizer(plan.recipe.model), quant_storage=plan.quant_storage)
    return grads, row, packed_bytes(model)


@pytest.mark.parametrize("variant", ["fresh", "pretrained"])
def test_two_fsdp2_ranks_with_4bit_experts_equal_one_process(tmp_path, pretrained, variant):
    want_grads, want_row, want_packed = _one_process(tmp_path / "one", variant, pretrained)
    experts = [n for n in want_grads if ".experts." in n and "lora_" in n]
    assert len(experts) == 8 and all(want_grads[n].abs().max() > 0 for n in experts)  # they train

    keys = [*COMMON, "distributed.engine=fsdp", "batch.micro_batch_size=1"]  # ranks x accumulation 2
    got = launch(__file__, tmp_path, [json.dumps([variant]), str(pretrained)], keys)[variant]

    diff = max_abs_diff(got["grads"], want_grads)
    print(f"fsdp {variant}: step {STEPS} LoRA gradients differ by {diff:.2e} from one process")
    assert diff <= 1e-5, diff
    assert got["row"]["loss"] == pytest.approx(want_row["loss"], rel=1e-5)
    # the same 4-bit experts, to the bit: bytes and statistics (the meta build quantized them per rank)
    assert got["packed"].keys() == want_packed.keys() and len(want_packed) == 4
    for name, want in want_packed.items():
        assert torch.equal(got["packed"][name]["bytes"], want["bytes"]), name
        assert all(torch.equal(a, b) for a, b in zip(got["packed"][name]["state"], want["state"], strict=True))
    # gathered by their MLP's unit (a CPU run's unit per MLP: llmft.engines.fsdp.layer_parts), not the root's
    assert len(got["units"]) == 2 and all(unit.endswith(".mlp") for unit in got["units"].values()), got["units"]
    # each rank holds about half of every packed weight, in the compute dtype (fp32: 8 weights each)
    for name, (local, whole, dtype, logical) in got["local"].items():
        assert dtype == torch.float32 and whole * 8 == logical, name
        assert abs(local - whole / 2) <= 1, (name, local, whole)


def test_train_then_export_gives_an_adapter_peft_loads_on_the_unquantized_base(tmp_path):
    """As every sharded QLoRA run (tests/distributed/test_export_sharded.py), the adapter is exported with
    the unquantized base rebuilt from the seed: PEFT on it gives the consolidated checkpoint's logits, and
    those are the trained 4-bit model's up to what quantization moves the base itself."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.export.consolidate import load_checkpoint_model, trainable_state
    from llmft.model.build import build_model
    from llmft.recipe import load_recipe

    recipe = write_recipe(tmp_path, model__config=CONFIG)
    done = torchrun(["train", str(recipe), "train.max_steps=2", "distributed.engine=fsdp", "optim.lr=0.02", *QLORA])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "experts: gate_up_proj, down_proj of 2 MoE layers in 4 bits" in done.stderr
    run = tmp_path / "run"
    consolidated, *_ = load_checkpoint_model(run)  # the trained adapter on the unquantized base
    ids = byte_tokenizer()(["reverse abc", "reverse xyz"], return_tensors="pt")["input_ids"]

    def logits(model):
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    want = logits(consolidated)
    with torch.no_grad(), consolidated.disable_adapter():
        unquantized = logits(consolidated)
    assert (unquantized - want).abs().max() > 1e-3  # the adapter trained: a real check

    def export(out: Path, *flags: str) -> Path:
        cmd = [sys.executable, "-m", "llmft", "export", str(run), "--out", str(out), *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        return out

    adapter = export(tmp_path / "adapter")
    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    peft_logits = logits(PeftModel.from_pretrained(base, adapter))
    torch.testing.assert_close(peft_logits, want, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(
        export(tmp_path / "merged", "--merge-lora"), attn_implementation="eager"
    )
    torch.testing.assert_close(logits(merged), want, rtol=1e-5, atol=1e-5)

    # the model the ranks trained: the 4-bit experts (as one process packs them, to the bit) with the adapter
    four_bit = build_model(load_recipe(recipe, [*QLORA, "distributed.engine=single"]), byte_tokenizer())
    assert len(experts_modules(four_bit)) == 2
    with torch.no_grad():
        quant_error = float((logits(four_bit) - unquantized).abs().max())  # B is 0: the bases alone
        missing, unexpected = four_bit.load_state_dict(trainable_state(consolidated), strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    diff = float((peft_logits - logits(four_bit)).abs().max())
    print(
        f"logits, max |diff|: PEFT on the unquantized base vs the trained 4-bit model {diff:.3g}, bases {quant_error:.3g}"
    )
    assert 1e-3 < diff <= 1.5 * quant_error


def run_probe(recipe: str, out: str, variants: str, pretrained: str, overrides: tuple, inspect) -> None:
    """Under torchrun: each variant's two steps on this rank's share; ``inspect(model, plan)`` (every
    rank: its collectives) adds what the engine holds of the packed experts; rank 0 saves the
    gradients, the metrics row and that."""
    import llmft.engines
    from llmft.job.dist import init_distributed, leave_process, read_env, timeout_s
    from llmft.plan.resolve import load_plan

    env = read_env()
    built = []
    build_engine = llmft.engines.build_engine

    def keep(*args, **kwargs):
        built.append(build_engine(*args, **kwargs))
        return built[-1]

    llmft.engines.build_engine = keep  # preference_step builds the engine; the experts are read from it
    results = {}
    for i, variant in enumerate(json.loads(variants)):
        over = [*overrides, *_variant_overrides(variant, pretrained)]
        plan = load_plan(recipe, over, world_size=env.world_size, local_world_size=env.local_world_size)
        if i == 0:
            d = plan.recipe.distributed
            init_distributed(env, d.backend, timeout_s(d), force=plan.spec.multi_rank)
        grads, row = preference_step(
            plan, env, _steps(plan.batch.micro_batch_size, env.rank, env.world_size), steps=STEPS
        )
        results[variant] = {"grads": grads, "row": row, **inspect(built[-1].unwrap(), plan)}
    if env.is_main:
        torch.save(results, out)
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)


def _held_by_fsdp2(model, plan) -> dict:
    """The gathered packed experts, each rank's share of them and the FSDP2 unit that gathers them."""
    from torch.distributed.fsdp import FSDPModule

    local, units = {}, {}
    for where, module in experts_modules(model):
        # the FSDP2 unit that gathers the experts: the innermost one holding them
        units[where] = max(
            (n for n, m in model.named_modules() if isinstance(m, FSDPModule) and where.startswith(n)), key=len
        )
        for name in FUSED:
            p = getattr(module, name)
            local[f"{where}.{name}"] = (
                p.to_local().numel(),
                p.numel(),
                p.dtype,
                module.llmft_quant[name].shape.numel(),
            )
    return {"packed": packed_bytes(model), "local": local, "units": units}  # packed_bytes: every rank gathers


def main(recipe: str, out: str, variants: str, pretrained: str, *overrides: str) -> None:
    run_probe(recipe, out, variants, pretrained, overrides, _held_by_fsdp2)


if __name__ == "__main__":
    main(*sys.argv[1:])
