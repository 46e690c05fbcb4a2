"""``checkpoints/base_model``: the random base of a ``model.config`` + PEFT run, written once.

The random base exists nowhere else; with it saved, exporting an adapter does not depend on
rebuilding it from ``run.seed`` with the same library versions. Only where rank 0 holds the whole
model (single, DDP, DeepSpeed ZeRO 0-2): where the engine shards the parameters (FSDP2, ZeRO-3),
gathering the base would put it whole on one rank, so export rebuilds it from ``model.config``
and ``run.seed`` (the engines build fresh models from that seed) and says so.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmft.checkpoint.layout import BASE_DIR, CHECKPOINTS
from llmft.job.dist import DistEnv
from llmft.model.precision import compute_dtype
from llmft.model.save import save_base_model
from llmft.plan.layout import RunPlan

if TYPE_CHECKING:  # engines/ builds models with this package: a real import would be a cycle
    from llmft.engines import Engine

log = logging.getLogger("llmft")


def save_base_once(plan: RunPlan, engine: Engine, run_dir: Path, env: DistEnv, *, resuming: bool) -> None:
    """Write ``checkpoints/base_model`` from the model ``engine`` trains, unless the run this one
    resumes already did."""
    recipe = plan.recipe
    if not env.is_main or recipe.model.config is None or not plan.peft:
        return
    target = Path(run_dir) / CHECKPOINTS / BASE_DIR
    if resuming and (target / "config.json").is_file():  # written by the run this one resumes
        return  # (a fresh start rewrites it: one left by an attempt without checkpoints may be stale)
    if plan.layout.shards_params:
        log.info("base model not saved (parameters sharded by %s); export rebuilds it from model.config", plan.engine)
        if not resuming:
            shutil.rmtree(target, ignore_errors=True)  # from an earlier attempt, maybe with another model
        return
    with torch.random.fork_rng(devices=[]):  # saving must not shift the run's random stream
        save_base_model(engine.unwrap(), target, dtype=compute_dtype(recipe))
