"""``llmft plan``: the memory table of a resolved run, whether it fits, and the micro-batch that would."""

from __future__ import annotations

from typing import Callable

from llmft.errors import UserError
from llmft.plan.engines import load
from llmft.plan.kernels import chosen_attention
from llmft.plan.layout import RunPlan
from llmft.plan.memory import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    format_estimate,
    host_mapped_per_rank,
    host_memory_per_rank,
    longest_sequence,
    pick_micro_batch,
)
from llmft.plan.resolve import describe_engine, load_plan
from llmft.plan.shape import model_shape, params_line


def plan_command(
    recipe_path: str,
    overrides: list[str],
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    measure_gpu: Callable[[], float | None] = lambda: None,
) -> str:
    """The text ``llmft plan`` prints. ``measure_gpu``: this machine's GPU memory in GiB (None: no
    GPU), asked only when the recipe leaves ``distributed.gpu_memory_gb`` unset (``llmft.job.gpu``)."""
    plan = load_plan(recipe_path, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node)
    recipe = plan.recipe
    est = estimate_memory(plan)
    head = [
        f"model {recipe.model.name_or_path or recipe.model.config.get('model_type')}: "
        f"{_describe(plan)}, engine {describe_engine(plan)}",
        *([line] if (line := params_line(model_shape(recipe.model))) else []),
        f"{plan.equation()}, {est.seq_len} tokens per sequence" + _rows(plan, est),
        *summary_lines(plan),
        kernels_line(plan),
        "",
        format_estimate(est),
        "",
    ]
    head += [f"note: {n}" for n in est.notes]
    head.append(host_line(plan))
    return "\n".join(head + _fit_lines(plan, est, measure_gpu))


def host_line(plan: RunPlan) -> str:
    """Host RAM per rank at its peak: with a GPU (loading, offloaded state), and on a CPU-only run,
    where the step's tensors are host memory too (docs/benchmarks.md measures both)."""
    gpu, cpu = host_memory_per_rank(plan), host_memory_per_rank(plan, device_is_host=True)
    mapped = host_mapped_per_rank(plan)
    files = f" (+ {mapped / GIB:.2f} GiB of the weight files read in place, page cache)" if mapped else ""
    return f"host RAM per rank (peak): {gpu / GIB:.2f} GiB with a GPU, {cpu / GIB:.2f} GiB on a CPU-only run{files}"


def summary_lines(plan: RunPlan) -> list[str]:
    """The objective's lines under the batch line of ``llmft compile``, ``llmft plan`` and the
    banner (``ObjectiveSpec.summary``; none for most)."""
    spec = plan.objective_spec
    return list(load(spec.summary)(plan)) if spec.summary else []


def _rows(plan: RunPlan, est: MemoryEstimate) -> str:
    """How a batch of items of several sequences each (preference pairs) counts, and where its
    reference comes from."""
    if est.rows_per_item == 1:
        return ""
    micro, unit = plan.batch.micro_batch_size, plan.objective_spec.unit
    return (
        f"; the batch counts {unit}: a micro-batch of {micro} {unit} runs {micro * est.rows_per_item} sequences; "
        f"reference: {plan.reference}" + (" (precomputed)" if plan.recipe.preference.precompute_reference else "")
    )


def _describe(plan: RunPlan) -> str:
    m, p = plan.recipe.model, plan.recipe.peft
    what = "full fine-tune" if p.method == "none" else f"{p.method} r={p.r}"
    quant = f", {m.quantization.bits}-bit base" if m.quantization is not None else ""
    ckpt = ", gradient checkpointing" if m.gradient_checkpointing else ""
    return f"{what}{quant}, {m.dtype}{ckpt}, optimizer {plan.recipe.optim.name}"


def kernels_line(plan: RunPlan, attention: str | None = None) -> str:
    """Which attention and which kernels the run uses (the banner prints it too, with ``attention``:
    what ``auto`` picked on this machine; ``llmft plan`` runs without torch and says what it would pick)."""
    m = plan.recipe.model
    attn = m.attn_implementation
    if attn == "auto":
        elsewhere = chosen_attention("auto", plan.recipe.data.packing, flash=False)
        attn = (
            f"auto -> {attention}"
            if attention
            else f"auto (flash_attention_2 with flash-attn on CUDA, else {elsewhere})"
        )
    hub = "on (downloaded from the Hugging Face Hub at load)" if m.hub_kernels else "off"
    on_off = {True: "on", False: "off"}
    return (
        f"attention {attn}; kernels: hub kernels {hub}, liger {on_off[bool(m.liger_kernels)]}, "
        f"compile {on_off[bool(m.compile)]}"
    )


def _fit_lines(plan: RunPlan, est: MemoryEstimate, measure_gpu: Callable[[], float | None]) -> list[str]:
    gb, source = plan.recipe.distributed.gpu_memory_gb, "distributed.gpu_memory_gb"
    if gb is None:
        gb, source = measure_gpu(), "detected GPU"
    if gb is None:
        return ["fits: unknown (no GPU here); set distributed.gpu_memory_gb=24 (GiB per GPU) to check"]
    verdict = "yes" if est.fits(gb) else "NO"
    lines = [f"fits in {gb:g} GiB ({source}): {verdict}, {(gb * GIB - est.total) / GIB:+.2f} GiB to spare"]
    try:
        best = pick_micro_batch(plan.recipe, plan.engine, plan.batch.global_batch_size, plan.layout, gb)
        lines.append(f"largest micro-batch that fits and divides the local batch: {best}")
    except UserError as e:
        lines.append(f"no micro-batch fits: {e.problems[0].what}")
    return lines + [_longest_line(plan, gb)]


def _longest_line(plan: RunPlan, gb: float) -> str:
    """The longest sequence a rank fits with this recipe's long-context switches."""
    m = plan.recipe.model
    switches = [
        f"sequence_parallel {plan.layout.sp}",
        f"activation_offload {str(m.activation_offload).lower()}",
        f"tiled_mlp {str(m.tiled_mlp).lower()}",
        f"chunked loss {'on' if plan.chunked_loss else 'off'}",
        f"gradient checkpointing {'on' if m.gradient_checkpointing else 'off'}",
    ]
    micro = plan.batch.micro_batch_size
    n = longest_sequence(plan.recipe, plan.engine, plan.layout, gb, micro)
    return (
        f"longest sequence that fits in {gb:g} GiB per GPU at micro-batch {micro}: {n} tokens ({', '.join(switches)})"
    )
