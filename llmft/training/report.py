"""What a training run tells its user: the banner at start (nanoGPT's batch arithmetic), the
progress bar, the extra columns of each train row (MFU, peak memory), the report at the end,
and the library versions a checkpoint records."""

from __future__ import annotations

import importlib.metadata as md
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from llmft.checkpoint.layout import latest_checkpoint
from llmft.engines import Engine
from llmft.job.dist import DistEnv
from llmft.metrics.flops import flops_per_token, mfu, peak_flops
from llmft.metrics.plot import plot_run
from llmft.model import attention
from llmft.model.moe import experts_line
from llmft.model.structure import describe
from llmft.plan.kernels import kernel_paths_line
from llmft.plan.layout import RunPlan
from llmft.plan.report import kernels_line, summary_lines
from llmft.plan.resolve import describe_engine
from llmft.plan.shape import model_shape
from llmft.training.loop import LoopState

log = logging.getLogger("llmft")

VERSIONED = ("llmft", "torch", "transformers", "peft", "deepspeed", "bitsandbytes")


def banner(plan: RunPlan, env: DistEnv, steps: int, engine: Engine, data) -> str:
    recipe, b, spec = plan.recipe, plan.batch, plan.objective_spec
    seq = recipe.data.max_seq_len
    rows = spec.rows(recipe)  # sequences one item becomes (the record's rows_per_item): a pair is two
    per_item = rows * seq
    shape = (
        f"{b.global_batch_size} {spec.unit} x {rows} sequences x {seq}"
        if rows > 1
        else f"{b.global_batch_size} sequences x {seq}"
    )
    items = spec.items(recipe)  # its unit (a pair, a completion), or a packed row
    lines = [
        f"batch: {plan.equation()}",
        *summary_lines(plan),
        f"tokens per optimizer step: {'' if spec.packed(recipe) else 'up to '}{b.global_batch_size * per_item:,} "
        f"({shape})",
        f"engine: {describe_engine(plan)}, {env.world_size} process(es), device {env.device.type}, "
        f"dtype {recipe.model.dtype}",
        kernels_line(plan, attention.choose(recipe.model.attn_implementation, recipe.data.packing)),
        f"parameters: {describe(engine.unwrap())}",
        *([f"mixture of experts: {line}"] if (line := experts_line(engine.unwrap())) else []),
        f"data: {len(data.train):,} training {items}, "
        f"{steps} optimizer steps ({steps * b.global_batch_size / max(len(data.train), 1):.2f} epochs)"
        if data.num_rows is not None  # a stream's length is unknown
        else f"data: streamed, {steps} optimizer steps ({steps * b.global_batch_size:,} {spec.unit if rows > 1 else 'rows'})",
    ]
    paths = kernel_paths_line(recipe.model)  # compile and Liger: which one runs each part of the model
    return "\n".join([*lines, paths] if paths else lines)


def versions() -> dict[str, str]:
    """The installed versions of llmft and the libraries a checkpoint's files depend on."""
    out = {}
    for pkg in VERSIONED:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def extra_metrics(plan: RunPlan, env: DistEnv) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """MFU and peak memory per train row (MFU only where the device's peak is known)."""
    recipe = plan.recipe
    shape = model_shape(recipe.model)
    per_token = flops_per_token(shape, recipe.data.max_seq_len, peft=plan.peft) if shape else None
    peak = peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)

    def extra(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"mfu": mfu(row["tokens_per_s"], per_token, peak, env.world_size) if per_token else None}
        if torch.cuda.is_available():
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    return extra


def report_done(run_dir: Path) -> None:
    plot = None
    try:
        plot = plot_run(run_dir)
    except Exception as e:  # the plot is a convenience; never fail a finished run over it
        log.warning("could not plot metrics: %s", e)
    log.info(
        "done.\n  model:      %s (export: llmft export %s)\n  metrics:    %s\n  plot:       %s",
        latest_checkpoint(run_dir),
        run_dir,
        run_dir / "metrics.jsonl",
        plot,
    )


class ProgressBar:
    """tqdm on stderr, one tick per optimizer step, with the step's loss, lr and tokens/s."""

    def __init__(self, steps: int, first_step: int) -> None:
        from tqdm import tqdm  # only runs with a progress bar pay for the import

        self.bar = tqdm(
            total=steps,
            initial=first_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None,
        )

    def update(self, st: LoopState, row: dict[str, Any]) -> None:
        self.bar.set_postfix(
            loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
