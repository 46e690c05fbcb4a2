"""model.compile under FSDP2 on 2 torchrun ranks gives the eager losses."""

from __future__ import annotations

import pytest
from helpers import metrics, write_recipe

COMPILED = dict(data__packing=True, train__max_steps=3, model__attn_implementation="sdpa")


@pytest.mark.slow  # two torchrun jobs of 2 ranks, one compiling in each rank: ~1-2 min on 2 cores
@pytest.mark.distributed
def test_compile_under_fsdp2_gives_eager_losses(tmp_path):
    """Layers compiled before ``fully_shard`` (FSDP2 hooks outside the compiled region), 2 ranks on
    gloo: the same losses as the eager FSDP2 run to 1e-5 relative."""
    from helpers import torchrun

    runs = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        recipe = write_recipe(tmp_path / name, **COMPILED)
        done = torchrun(
            ["train", str(recipe), "distributed.engine=fsdp", "distributed.nproc_per_node=2", f"model.compile={flag}"],
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("torch.compile: 2 decoder layer(s)" in done.stdout + done.stderr) == (flag == "true")
        runs[name] = metrics(tmp_path / name / "run")
    assert len(runs["compiled"]) == len(runs["eager"]) == 3
    for a, b in zip(runs["compiled"], runs["eager"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
