"""Preemption with the defaults (docs/design.md G3): a stop signal sent to the whole
process group, as a scheduler sends it (launcher, ranks and DataLoader workers alike), ends in a
boundary checkpoint and exit 75, with DataLoader workers running (``data.num_workers >= 1``).

The launcher is started in a new session and the signal goes to that session's process group
with ``os.killpg``; the DataLoader workers are in the group, so before they ignored the stop
signals they died of it and the training process failed inside the step with
``DataLoader worker (pid ...) is killed by signal: Terminated``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import INSTRUMENTED, ROOT, checkpoint_weights, metrics, wait_for_step, write_data, write_recipe

# LoRA with dropout, shuffle and packing (as tests/integration/test_resume.py), data from one worker.
EXACT = dict(
    peft__method="lora",
    peft__dropout=0.1,
    peft__r=4,
    data__packing=True,
    data__shuffle=True,
    data__num_workers=1,
    batch__global_batch_size=4,
    batch__micro_batch_size=2,
    train__max_steps=8,
    checkpoint__every_steps=None,  # the only mid-run checkpoint is the one the stop writes
)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _cmd(recipe: Path) -> list[str]:
    return [sys.executable, INSTRUMENTED, "train", str(recipe)]


def _stopped_by_killpg(root: Path, **keys) -> tuple[Path, int]:
    """``llmft train`` started in a new session, its process group sent SIGTERM after step 2."""
    write_data(root / "train.jsonl", n=40)
    recipe = write_recipe(root, **{**EXACT, **keys})
    # A new session: the launcher leads its own process group, which the scheduler signals whole.
    proc = subprocess.Popen(
        _cmd(recipe), stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True
    )
    try:
        wait_for_step(root / "run", 2, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "is killed by signal" not in err, err[-3000:]
    assert proc.returncode == 75, err[-3000:]
    stop = int((root / "run/checkpoints/latest").read_text().strip().removeprefix("step-"))
    assert f"stopped by SIGTERM after step {stop}; checkpoint written" in err
    assert 2 <= stop < 8
    assert (root / f"run/checkpoints/step-{stop}/COMPLETE").exists()
    assert max(r["step"] for r in metrics(root / "run")) == stop  # on the boundary, nothing past it
    return recipe, stop


def test_sigterm_to_the_process_group_with_a_data_worker_checkpoints_at_a_boundary(tmp_path):
    _stopped_by_killpg(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [1, 2])
def test_sigterm_to_the_process_group_then_resume_is_bit_exact(tmp_path, num_workers):
    ref = tmp_path / "ref"
    write_data(ref / "train.jsonl", n=40)
    recipe = write_recipe(ref, **{**EXACT, "data__num_workers": num_workers})
    done = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    run = tmp_path / "stopped"
    recipe, stop = _stopped_by_killpg(run, data__num_workers=num_workers)
    done = subprocess.run(_cmd(recipe), capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step-{stop} (step {stop}," in done.stderr  # resumed from the stop's checkpoint
    rows, ref_rows = metrics(run / "run"), metrics(ref / "run")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]  # bit for bit
    got, want = checkpoint_weights(run / "run/checkpoints/step-8"), checkpoint_weights(ref / "run/checkpoints/step-8")
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
