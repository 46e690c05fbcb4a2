"""QLoRA's 4-bit experts under DeepSpeed ZeRO (llmft/model/moe_quant.py; docs/moe.md): 2 processes on gloo
under torchrun, each with 2 of the 4 examples of every step (micro 1 x accumulation 2), give after two SGD
steps the LoRA gradients (the experts' and the attention's) and the logged loss of one process with the
whole batch, with the same packed experts to the bit; under ZeRO-3 each rank holds about half of every
packed fused expert weight.

Two builds, as in test_moe_quant_fsdp.py (whose helpers this file imports): a fresh ``model.config``
model (quantized whole on every rank; ZeRO-3 then partitions it), and a pretrained one whose checkpoint
stores the experts per expert (under ZeRO-3 built on the meta device, each rank quantizing only the
blocks of its partition of the packed bytes: ``llmft.model.zero3.materialize``).

This file is also the probe that torchrun runs on each rank: ``python test_moe_quant_zero.py RECIPE
OUT_FILE VARIANTS_JSON PRETRAINED [KEY=VALUE ...]``; rank 0 writes {variant: {"grads", "row", "packed",
"local"}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_moe_quant_fsdp: the builds and helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, the step harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the examples and the tiny families

from test_moe import max_abs_diff  # noqa: E402
from test_moe_quant_fsdp import (  # noqa: E402
    COMMON,
    FUSED,
    _one_process,
    experts_modules,
    packed_bytes,
    pretrained,  # noqa: F401 (the fixture)
    run_probe,
)
from test_moe_ranks import STEPS, launch  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

VARIANTS = ["fresh", "pretrained"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pretrained):  # noqa: F811
    """One process with the whole batch, per build: the gradients, the logged row and the packed experts."""
    return {v: _one_process(tmp_path_factory.mktemp(f"one-{v}"), v, pretrained) for v in VARIANTS}


# CI: ZeRO-2 (whole packed experts, as ZeRO-1) and ZeRO-3 (partitioned); -m extended: ZeRO-1 too
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.extended), 2, 3])
def test_two_zero_ranks_with_4bit_experts_equal_one_process(tmp_path, pretrained, one_process, stage):  # noqa: F811
    keys = [*COMMON, "distributed.engine=deepspeed", f"distributed.zero_stage={stage}", "batch.micro_batch_size=1"]
    results = launch(__file__, tmp_path, [json.dumps(VARIANTS), str(pretrained)], keys)

    for variant in VARIANTS:
        want_grads, want_row, want_packed = one_process[variant]
        experts = [n for n in want_grads if ".experts." in n and "lora_" in n]
        assert len(experts) == 8 and all(want_grads[n].abs().max() > 0 for n in experts)  # they train
        got = results[variant]
        assert got["meta"] == (stage == 3 and variant == "pretrained")  # zero3.materialize quantized each part
        diff = max_abs_diff(got["grads"], want_grads)
        print(f"ZeRO-{stage} {variant}: step {STEPS} LoRA gradients differ by {diff:.2e} from one process")
        assert diff <= 1e-5, (variant, diff)
        assert got["row"]["loss"] == pytest.approx(want_row["loss"], rel=1e-5)
        # the same 4-bit experts, to the bit: bytes and statistics (ZeRO-3's meta build quantized them per rank)
        assert got["packed"].keys() == want_packed.keys() and len(want_packed) == 4
        for name, want in want_packed.items():
            assert torch.equal(got["packed"][name]["bytes"], want["bytes"]), (variant, name)
            pairs = zip(got["packed"][name]["state"], want["state"], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), (variant, name)
        # ZeRO-3 partitions the packed bytes (stored in the compute dtype, fp32: 8 weights each); below it
        # every rank holds them whole, in uint8 (2 weights each)
        for name, (local, whole, dtype, logical) in got["local"].items():
            if stage == 3:
                assert dtype == torch.float32 and whole * 8 == logical, name
                assert abs(local - whole / 2) <= 1, (variant, name, local, whole)
            else:
                assert dtype == torch.uint8 and whole * 2 == logical and local == whole, (variant, name)


def _held_by_zero(model, plan) -> dict:
    """The gathered packed experts and each rank's partition of them (whole below ZeRO-3)."""
    import deepspeed

    local, params = {}, []
    for where, module in experts_modules(model):
        for name in FUSED:
            p = getattr(module, name)
            params.append(p)
            partitioned = hasattr(p, "ds_tensor")
            local[f"{where}.{name}"] = (
                p.ds_tensor.numel() if partitioned else p.numel(),
                p.ds_numel if partitioned else p.numel(),
                p.dtype,
                module.llmft_quant[name].shape.numel(),
            )
    with deepspeed.zero.GatheredParameters(params):  # collective under ZeRO-3: every rank gathers
        packed = packed_bytes(model)
    return {"packed": packed, "local": local, "meta": plan.meta_init}


def main(recipe: str, out: str, variants: str, pretrained: str, *overrides: str) -> None:  # noqa: F811
    run_probe(recipe, out, variants, pretrained, overrides, _held_by_zero)


if __name__ == "__main__":
    main(*sys.argv[1:])
