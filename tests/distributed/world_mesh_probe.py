"""Run under torchrun (2 ranks, gloo): every group the engines use is a view of the one world mesh.

``world_mesh_probe.py RECIPE``: builds the FSDP2 engine for RECIPE with ``distributed.sequence_parallel``
2 and 1, and lays out a plan with the test dimension of tests/tensor_dimension.py (2 tensor-parallel
ranks); records, for each, whose root mesh FSDP2's mesh and every sharded parameter's mesh are, the
ranks of FSDP2's mesh, of the sequence group and of Ulysses' installed group, and runs one forward
and backward through the sharded model. Prints ``WORLD_MESH {rank: report}`` on rank 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test dimension
import tensor_dimension  # noqa: E402  (registers the "tp" record)

from llmft.data.tokenizer import load_tokenizer  # noqa: E402
from llmft.engines.fsdp import FSDPEngine  # noqa: E402
from llmft.job.dist import (  # noqa: E402
    init_distributed,
    leave_process,
    param_mesh,
    read_env,
    run_mesh,
    sequence_group,
    world_mesh,
)
from llmft.model import ulysses  # noqa: E402
from llmft.plan.resolve import load_plan  # noqa: E402
from llmft.training.optim import build_optimizer  # noqa: E402


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _engine(recipe: str, env, sp: int) -> dict:
    plan = load_plan(recipe, ["distributed.engine=fsdp", f"distributed.sequence_parallel={sp}"], world_size=2)
    tokenizer = load_tokenizer(plan.recipe.model)
    engine = FSDPEngine(plan, env, tokenizer, lambda m: build_optimizer(m, plan.recipe.optim, plan.recipe.optim.lr))
    world = world_mesh("cpu")
    meshes = {p.device_mesh for p in engine.model.parameters() if isinstance(p, DTensor)}
    out = {
        "fsdp_mesh": list(engine.mesh.mesh_dim_names),
        "fsdp_ranks": _ranks(engine.mesh.get_group()),
        "fsdp_root_is_world": engine.mesh._get_root_mesh() is world,
        "params_on_fsdp_mesh": meshes == {engine.mesh},
    }
    if sp > 1:
        group = sequence_group(plan.layout.mesh)
        installed = {impl: u.process_group is group for impl, u in ulysses._INSTALLED.items()}
        out |= {
            "sp_ranks": _ranks(group),
            "sp_root_is_world": run_mesh("cpu", plan.layout.mesh)._get_root_mesh() is world,
            "ulysses_on_sp_group": installed,
        }
    else:  # one forward and backward through the sharded model (sequence parallelism needs slices)
        ids = torch.arange(16).view(2, 8) % 50 + 3
        engine.model(input_ids=ids, labels=ids).loss.backward()
        out["grads"] = all(p.grad is not None for p in engine.model.parameters() if p.requires_grad)
    return out


def _tensor_parallel(recipe: str) -> dict:
    os.environ[tensor_dimension.ENV] = "2"
    plan = load_plan(recipe, ["distributed.engine=fsdp"], world_size=2)
    world = world_mesh("cpu")
    tp = run_mesh("cpu", plan.layout.mesh)["tp"]
    fsdp = param_mesh("cpu", plan.layout)
    return {
        "equation": plan.batch.equation(),
        "tp_ranks": _ranks(tp.get_group()),
        "tp_root_is_world": tp._get_root_mesh() is world,
        "fsdp_size": fsdp.size(),
        "fsdp_root_is_world": fsdp._get_root_mesh() is world,
    }


def main() -> None:
    (recipe,) = sys.argv[1:]
    env = read_env()
    init_distributed(env, "gloo", 60, force=True)
    report = {"sp2": _engine(recipe, env, 2), "sp1": _engine(recipe, env, 1), "tp2": _tensor_parallel(recipe)}
    report["world_is_default_group"] = world_mesh("cpu").get_group() is dist.group.WORLD
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, report)
    if env.rank == 0:
        print("WORLD_MESH " + json.dumps(dict(enumerate(everyone))), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)
