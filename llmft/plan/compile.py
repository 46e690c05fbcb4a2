"""``llmft compile``: one validated recipe -> every artefact an engine or launcher reads.

Everything is derived from the same solved batch, so the numbers in
``recipe.yaml``, ``ds_config.json``, ``fsdp.yaml`` and the launch scripts
cannot disagree. Imports no torch and no deepspeed: compiling runs anywhere,
in well under a second.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from llmft.plan import launch
from llmft.plan.batch import BatchPlan
from llmft.plan.deepspeed import deepspeed_config
from llmft.plan.fsdp import accelerate_config, fsdp_plan
from llmft.plan.shape import model_shape
from llmft.recipe.load import RECIPE_FILE, to_yaml
from llmft.recipe.schema import Recipe
from llmft.recipe.validate import batch_plan

DS_CONFIG = "ds_config.json"
FSDP_PLAN = "fsdp.yaml"
ACCELERATE_CONFIG = "accelerate.yaml"
# Artefacts that belong to one engine: removed when a recompile picks another, so a
# compiled dir never holds a stale config that disagrees with its recipe.
ENGINE_FILES = (DS_CONFIG, FSDP_PLAN, ACCELERATE_CONFIG, *(f"launch/{n}" for n in launch.DEEPSPEED_ONLY))


def _header(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _tokens_line(recipe: Recipe, plan: BatchPlan) -> str:
    """Packed rows are always max_seq_len long; unpacked ones only up to it."""
    tokens = plan.global_batch_size * recipe.data.max_seq_len
    bound = "" if recipe.data.packing else "up to "
    how = "packed" if recipe.data.packing else "padded"
    return (
        f"tokens per optimizer step: {bound}{tokens:,} "
        f"(global {plan.global_batch_size} x max_seq_len {recipe.data.max_seq_len}, {how})"
    )


def _engine_line(recipe: Recipe) -> str:
    d = recipe.distributed
    line = f"engine: {d.engine}"
    if d.engine == "deepspeed":
        line += f", ZeRO stage {d.zero_stage}"
        offload = [
            f"{what} -> {where}"
            for what, where in (("optimizer", d.offload_optimizer), ("params", d.offload_params))
            if where != "none"
        ]
        if offload:
            line += f" (offload {', '.join(offload)})"
    elif d.engine == "fsdp":
        line += (
            f" (FSDP2, mesh {d.hsdp_replicate} replica(s) x {d.nnodes * d.nproc_per_node // d.hsdp_replicate} shard(s))"
        )
    return line


def _launch_hint(recipe: Recipe, out: Path) -> str:
    d = recipe.distributed
    if d.nnodes * d.nproc_per_node == 1:
        return f"run: llmft train {out}"
    if d.nnodes > 1:
        return f"run: sbatch {out / 'launch/slurm.sbatch'}   (or {out / 'launch/torchrun.sh'} on every node)"
    script = "deepspeed.sh" if d.engine == "deepspeed" else "torchrun.sh"
    return f"run: bash {out / 'launch' / script}"


def _job_name(recipe: Recipe) -> str:
    """A name that is safe unquoted in #SBATCH lines and as torchrun's rendezvous id."""
    name = recipe.run.name or Path(recipe.run.output_dir).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "llmft"


def _engine_files(recipe: Recipe, head: list[str]) -> dict[str, str]:
    """The engine's own configs: ds_config.json, or the FSDP2 plan and accelerate config."""
    d = recipe.distributed
    if d.engine == "deepspeed":
        # JSON has no comments: the equation is in recipe.yaml and in the batch keys themselves.
        return {DS_CONFIG: json.dumps(deepspeed_config(recipe, model_shape(recipe.model)), indent=2) + "\n"}
    if d.engine != "fsdp":
        return {}
    plan = fsdp_plan(recipe)
    how = [f"accelerate launch --config_file {ACCELERATE_CONFIG} -m llmft train <this directory>"]
    if d.nnodes > 1:
        how.append("On each node add --machine_rank <0..num_machines-1> --main_process_ip <host of node 0>.")
    return {
        FSDP_PLAN: _header([*head, "The FSDP2 plan llmft applies at run time (recomputed from recipe.yaml)."])
        + _yaml(plan),
        ACCELERATE_CONFIG: _header([*head, *how]) + _yaml(accelerate_config(recipe, plan)),
    }


def compile_recipe(recipe: Recipe, out: Path) -> str:
    """Write the compiled directory for a validated recipe; return the summary to print."""
    d = recipe.distributed
    out = Path(out)
    plan = batch_plan(recipe, d.nnodes * d.nproc_per_node)
    head = [f"Written by `llmft compile`: {plan.equation()}."]
    files = {
        RECIPE_FILE: _header([*head, "Fully resolved; `llmft train` accepts this directory."]) + to_yaml(recipe),
        **_engine_files(recipe, head),
    }

    out.mkdir(parents=True, exist_ok=True)
    for name in ENGINE_FILES:
        (out / name).unlink(missing_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    layout = launch.Layout(
        nnodes=d.nnodes,
        nproc_per_node=d.nproc_per_node,
        master_port=d.master_port,
        stop_signal=d.stop_signal,
        job_name=_job_name(recipe),
        header="\n".join([*head, f"Engine: {d.engine}. Recipe: ../{RECIPE_FILE}."]),
    )
    written += launch.write(out / "launch", launch.render(layout, d.engine))

    return "\n".join(
        [
            f"batch: {plan.equation()}",
            _tokens_line(recipe, plan),
            _engine_line(recipe),
            f"wrote {out}/:",
            *(f"  {p.relative_to(out)}" for p in written),
            _launch_hint(recipe, out),
        ]
    )
