"""The exact-match eval's generation on a sharding engine that ``distributed.engine: auto`` picked.

``auto`` resolves to FSDP2 for a multi-rank full fine-tune, where every forward all-gathers the
parameters from all ranks: a rank whose sequences are done must keep joining the others'
forwards (``synced_gpus``). The evaluator takes that from the plan (parameters sharded), not
from the recipe's ``distributed.engine``, which says ``auto``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from helpers import ROOT, metrics, torchrun_cmd, write_recipe

pytestmark = pytest.mark.distributed

EVAL = [
    "train.max_steps=1",
    "train.eval_every_steps=1",
    "train.eval_generate_samples=4",
    "data.eval_fraction=0.25",
    "batch.micro_batch_size=2",
]


def _generate(tmp_path, engine: str) -> dict[str, list]:
    recipe = write_recipe(tmp_path / engine)
    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed/eval_generate_probe.py"), str(recipe), *EVAL]
    cmd.append(f"distributed.engine={engine}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # A rank left waiting in an all-gather hangs until the process group's timeout: end the
        # launcher and both ranks (their own session), not only torchrun.
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"generation hung (synced_gpus off on sharded parameters?): {stderr[-2000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    resolved = (tmp_path / engine / "run" / "recipe.yaml").read_text()
    assert "engine: fsdp" in resolved  # auto resolved to FSDP2
    evals = metrics(tmp_path / engine / "run", "eval")
    assert evals and all(r["generated"] == 4 for r in evals)
    files = sorted(recipe.parent.glob("generated-*.json"))
    return {f.stem.removeprefix("generated-"): json.loads(f.read_text()) for f in files}


def test_auto_resolving_to_fsdp_generates_as_fsdp(tmp_path):
    auto = _generate(tmp_path, "auto")
    assert sorted(auto) == ["0", "1"] and all(auto.values())
    assert auto == _generate(tmp_path, "fsdp")
