"""``llmft compile``: one resolved run plan -> every artefact an engine or launcher reads.

Everything is derived from the same solved batch, so the numbers in
``recipe.yaml``, ``ds_config.json``, ``fsdp.yaml`` and the launch scripts
cannot disagree. Imports no torch and no deepspeed: compiling runs anywhere,
in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from llmft.errors import Problem, UserError
from llmft.plan import launch
from llmft.plan.engines import ENGINES, load
from llmft.plan.layout import RunPlan
from llmft.plan.report import summary_lines
from llmft.plan.resolve import PLAN_FILE, plan_summary
from llmft.recipe.load import RECIPE_FILE, to_yaml

# Artefacts that belong to one engine: removed when a recompile picks another, so a
# compiled dir never holds a stale config that disagrees with its recipe.
ENGINE_FILES = (
    *(name for spec in ENGINES for name in spec.config_names),
    *(f"launch/{n}" for n in launch.DEEPSPEED_ONLY),
)


# How every text file llmft compile writes begins (its header), and the hostfile's first line: a
# file of those names that begins otherwise is the user's, never replaced.
WRITTEN_BY = "# Written by `llmft compile`"
HOSTFILE_HEAD = "# DeepSpeed hostfile:"


def written_by_compile(out: Path, name: str) -> bool:
    """``out/name`` is a file an ``llmft compile`` wrote (``ds_config.json``, which JSON leaves
    without a header, counts as compile's where the ``recipe.yaml`` beside it is)."""
    path = out / name
    if path.is_symlink() or not path.is_file():
        return False
    if name.endswith(".json"):
        return written_by_compile(out, RECIPE_FILE)
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode(errors="replace")
    except OSError:
        return False
    # A launch script has its shebang (and slurm.sbatch its #SBATCH lines) before the header.
    return any(line.startswith((WRITTEN_BY, HOSTFILE_HEAD)) for line in head.splitlines())


def check_out(out: Path, names: list[str]) -> None:
    """Refuse an ``--out`` that holds, under a name compile writes, a file compile did not write."""
    theirs = sorted(
        n for n in set(names) if ((out / n).exists() or (out / n).is_symlink()) and not written_by_compile(out, n)
    )
    if theirs:
        raise UserError(
            Problem(
                str(out),
                f"holds {', '.join(theirs)}, which llmft compile did not write (they do not start with its "
                f"header `{WRITTEN_BY}`); compiling there would replace them",
                "Choose another --out (a new or empty directory), or move those files away.",
            )
        )


def _header(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _tokens_line(plan: RunPlan) -> str:
    """Packed rows are always max_seq_len long; unpacked ones only up to it."""
    data, global_batch = plan.recipe.data, plan.batch.global_batch_size
    tokens = global_batch * data.max_seq_len
    bound = "" if data.packing else "up to "
    how = "packed" if data.packing else "padded"
    return (
        f"tokens per optimizer step: {bound}{tokens:,} (global {global_batch} x max_seq_len {data.max_seq_len}, {how})"
    )


def _engine_line(plan: RunPlan) -> str:
    summary = plan.spec.summary
    return load(summary)(plan) if summary else f"engine: {plan.engine}"


def _launch_hint(plan: RunPlan, out: Path) -> str:
    if plan.world.size == 1:
        return f"run: llmft train {out}"
    if plan.world.nnodes > 1:
        return f"run: sbatch {out / 'launch/slurm.sbatch'}   (or {out / 'launch/torchrun.sh'} on every node)"
    return f"run: bash {out / 'launch' / f'{plan.spec.launcher}.sh'}"


def _job_name(recipe) -> str:
    """A name that is safe unquoted in #SBATCH lines and as torchrun's rendezvous id. A name read
    from the environment (``${oc.env:...}``) is not written into the scripts: it may be a secret."""
    from_env = getattr(recipe, "_env_refs", {})
    name = next(
        (
            v
            for k, v in (("run.name", recipe.run.name), ("run.output_dir", recipe.run.output_dir))
            if v and k not in from_env
        ),
        None,
    )
    name = Path(name).name if name else "llmft"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "llmft"


def _engine_files(plan: RunPlan, head: list[str]) -> dict[str, str]:
    """The engine's own configs (``EngineSpec.config_files``): ds_config.json, or the FSDP2 plan
    and accelerate config."""
    writer = plan.spec.config_files
    return load(writer)(plan, head) if writer else {}


def compile_recipe(plan: RunPlan, out: Path) -> str:
    """Write the compiled directory of a resolved run; return the summary to print."""
    recipe = plan.recipe
    d = recipe.distributed
    out = Path(out)
    head = [f"Written by `llmft compile`: {plan.equation()}."]
    files = {
        RECIPE_FILE: _header([*head, "Fully resolved; `llmft train` accepts this directory."])
        + to_yaml(plan.resolved_recipe()),
        PLAN_FILE: _header([*head, "Every decision llmft took about this run (llmft.plan.resolve); for reading."])
        + _yaml(plan_summary(plan)),
        **_engine_files(plan, head),
    }

    layout = launch.Layout(
        nnodes=plan.world.nnodes,
        nproc_per_node=plan.world.nproc_per_node,
        master_port=d.master_port,
        stop_signal=d.stop_signal,
        job_name=_job_name(recipe),
        header="\n".join([*head, f"Engine: {plan.engine}. Recipe: ../{RECIPE_FILE}."]),
    )
    scripts = launch.render(layout, plan.spec.launcher)
    check_out(out, [*files, *ENGINE_FILES, *(f"launch/{n}" for n in scripts)])
    out.mkdir(parents=True, exist_ok=True)
    for name in ENGINE_FILES:
        (out / name).unlink(missing_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    written += launch.write(out / "launch", scripts)

    return "\n".join(
        [
            f"batch: {plan.equation()}",
            *summary_lines(plan),
            _tokens_line(plan),
            _engine_line(plan),
            *(f"note: {n}" for n in plan.notes),
            f"wrote {out}/:",
            *(f"  {p.relative_to(out)}" for p in written),
            _launch_hint(plan, out),
        ]
    )
