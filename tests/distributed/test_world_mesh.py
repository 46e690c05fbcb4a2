"""One world mesh (``llmft.job.dist.world_mesh``): FSDP2's mesh, every sharded parameter's mesh,
the sequence groups Ulysses runs its all-to-alls on and a dimension added from outside llmft
(tests/tensor_dimension.py) are all views of it, not meshes of their own; its group is the default
process group that DDP and the loop's collectives use. One torchrun launch of 2 ranks on gloo
(tests/distributed/world_mesh_probe.py). docs/design.md, "The parallel layout"."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ROOT, torchrun_cmd, write_recipe

pytestmark = pytest.mark.distributed


def test_fsdp2_and_the_sequence_groups_are_views_of_the_one_world_mesh(tmp_path):
    recipe = write_recipe(tmp_path, model__attn_implementation="sdpa")
    cmd = [*torchrun_cmd(2), str(ROOT / "tests/distributed/world_mesh_probe.py"), str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-6000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("WORLD_MESH "))
    reports = json.loads(line.split(" ", 1)[1])
    assert set(reports) == {"0", "1"}
    for report in reports.values():
        fsdp = {"fsdp_mesh": ["shard"], "fsdp_ranks": [0, 1], "fsdp_root_is_world": True, "params_on_fsdp_mesh": True}
        assert report["sp2"] == {
            **fsdp,  # parameters sharded over both ranks, the sequence ranks included
            "sp_ranks": [0, 1],
            "sp_root_is_world": True,
            "ulysses_on_sp_group": {"sdpa": True},
        }
        assert report["sp1"] == {**fsdp, "grads": True}
        assert report["tp2"] == {
            "equation": "micro 4 x accumulation 2 x data-parallel 1 (world 2 / tensor-parallel 2) = global 8",
            "tp_ranks": [0, 1],
            "tp_root_is_world": True,
            "fsdp_size": 1,  # the tensor ranks own their parameters: FSDP2 shards over one rank
            "fsdp_root_is_world": True,
        }
        assert report["world_is_default_group"] is True
