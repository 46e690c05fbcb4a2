"""A run that does not use DeepSpeed does not import it, and its checkpoints print no progress bar.

transformers' ``save_pretrained`` unwraps the model through accelerate, which imports deepspeed
whenever it is installed; llmft saves single and DDP checkpoints without that probe
(``llmft.engines.base.quiet_save_pretrained``). In a fresh process, since the test process itself
may have imported deepspeed already."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, write_recipe

CHECK = """
import sys
from llmft.training.train import train
code = train(sys.argv[1], sys.argv[2:])
print("DEEPSPEED_IMPORTED", "deepspeed" in sys.modules)
sys.exit(code)
"""


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_single_run_with_checkpoints_leaves_deepspeed_out(tmp_path, peft):
    recipe = write_recipe(tmp_path)
    args = ["distributed.engine=single", "checkpoint.every_steps=1", "train.max_steps=2", f"peft.method={peft}"]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(recipe), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run/checkpoints/step-2/model").is_dir()
    assert "DEEPSPEED_IMPORTED False" in done.stdout
    assert "Setting accelerator" not in done.stderr and "Writing model shards" not in done.stderr
