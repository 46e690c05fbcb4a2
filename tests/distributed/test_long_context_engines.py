"""model.activation_offload and model.tiled_mlp in whole training runs (docs/long-context.md): the same losses and
gradient norms as the run without them, on one process, on DeepSpeed ZeRO-3 over 2 gloo ranks
(where the tiles gather the MLP's weights and hold their gradients until the last tile), and on
FSDP2 and DDP (one checkpoint per tile: each gradient is reduced once, after the last tile).

Rows are packed to 256 tokens so that the tiny model's MLP (hidden 64) runs in 4 tiles. Each run is
4 AdamW steps with clipping; tolerances as tests/distributed/test_training.py: 1e-5 absolute on the
loss, 1e-3 relative on the pre-clip gradient norm.
"""

from __future__ import annotations

import pytest
from helpers import metrics, torchrun, train_inproc, write_recipe

pytestmark = pytest.mark.distributed

ADAMW = ["optim.name=adamw", "optim.lr=1e-3", "optim.scheduler=constant", "optim.max_grad_norm=1.0"]
RUN = [*ADAMW, "train.max_steps=4", "data.packing=true", "data.max_seq_len=256", "model.attn_implementation=sdpa"]
LORA = ["peft.method=lora", "peft.r=4", "peft.dropout=0"]
CHECKPOINTING = ["model.gradient_checkpointing=true"]
LONG = [*CHECKPOINTING, "model.activation_offload=true", "model.tiled_mlp=true", "model.chunked_loss=true"]
ZERO3 = ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=2"]
LOSS_TOL, NORM_RTOL = 1e-5, 1e-3
LAUNCH_TIMEOUT = 900


def _same_run(ref: list[dict], rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref]
    for r, want in zip(rows, ref, strict=True):
        assert abs(r["loss"] - want["loss"]) < LOSS_TOL, (r["step"], r["loss"], want["loss"])
        assert abs(r["grad_norm"] - want["grad_norm"]) <= NORM_RTOL * want["grad_norm"], r["step"]


def _launched_runs_match(tmp_path, common: list[str]) -> None:
    """Two 2-rank launches of ``common``, with checkpointing alone and with every switch: the same run."""
    runs = {}
    for name, extra in (("plain", CHECKPOINTING), ("long", LONG)):
        done = torchrun([*common, *extra, f"run.output_dir={tmp_path / name}"], timeout=LAUNCH_TIMEOUT)
        assert done.returncode == 0, done.stderr[-6000:]
        runs[name] = metrics(tmp_path / name)
    _same_run(runs["plain"], runs["long"])


@pytest.mark.slow  # ~30 s per case on 2 shared cores
@pytest.mark.parametrize("peft", [[], LORA], ids=["full", "lora"])
def test_single_process_long_context_switches_train_the_same(tmp_path, peft):
    recipe = write_recipe(tmp_path)
    common = [*RUN, *peft, "distributed.engine=single", "batch.micro_batch_size=8"]
    assert train_inproc(recipe, *common, *CHECKPOINTING, f"run.output_dir={tmp_path / 'plain'}") == 0
    assert train_inproc(recipe, *common, *LONG, f"run.output_dir={tmp_path / 'long'}") == 0
    _same_run(metrics(tmp_path / "plain"), metrics(tmp_path / "long"))


@pytest.mark.slow
def test_zero3_long_context_switches_train_the_same(tmp_path):
    recipe = write_recipe(tmp_path)
    common = ["train", str(recipe), *RUN, *LORA, *ZERO3]
    _launched_runs_match(tmp_path, common)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", pytest.param("ddp", marks=pytest.mark.extended)])
def test_fsdp_and_ddp_long_context_switches_train_the_same(tmp_path, engine):
    recipe = write_recipe(tmp_path)
    common = ["train", str(recipe), *RUN, *LORA, f"distributed.engine={engine}", "batch.micro_batch_size=2"]
    _launched_runs_match(tmp_path, common)
