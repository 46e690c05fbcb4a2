"""A rank that hangs ends the whole job (docs/reliability.md#a-rank-that-waits-too-long).

Two hangs are injected into a 2-rank DDP run under torchrun with ``distributed.timeout_s=20``:
a rank that sleeps inside the all-reduce of step 3 (``tests/instrumented.py``), and a rank frozen
from outside with SIGSTOP. Each time the ranks that can still run log the timeout with the step,
the phase and a Python stack of every thread, the launcher exits non-zero (the subprocess timeout
is the hang guard; no timing is asserted), and the last complete checkpoint resumes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, llmft_entry, metrics, torchrun, torchrun_cmd, train_inproc, wait_for_step, write_recipe

from llmft.checkpoint.layout import COMPLETE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 20
# timeout + torchrun's 30 s between SIGTERM and SIGKILL of the other ranks + start-up on 2 busy cores
GUARD_S = TIMEOUT_S + 30 + 240


def _recipe(tmp: Path, steps: int) -> Path:
    return write_recipe(
        tmp,
        distributed__engine="ddp",
        distributed__timeout_s=TIMEOUT_S,
        batch__micro_batch_size=2,  # accumulation 2 on 2 ranks
        train__max_steps=steps,
        checkpoint__every_steps=1,
    )


def _gave_up(stderr: str, rank: int) -> str:
    """The report of ``rank`` (its line and the stacks that follow it); fails if there is none."""
    found = re.search(rf"\[llmft rank {rank}\] rank {rank}: (.*?); it was in (.*?)\. The Python stack", stderr)
    assert found, f"rank {rank} logged no timeout:\n{stderr[-6000:]}"
    return stderr[found.start() :]


def _assert_stacks(report: str) -> None:
    assert "exiting with 124" in report
    assert "Current thread" in report or "Thread 0x" in report  # faulthandler's dump of every thread
    assert re.search(r'File ".*llmft/(training/loop|job/dist|training/train)\.py", line \d+ in ', report), report[:3000]


def _resume_from_last_checkpoint(recipe: Path, run_dir: Path, expect: int, capsys) -> None:
    """The newest complete checkpoint resumes (one process, DDP's plain files) and trains a step."""
    assert (run_dir / "checkpoints" / f"step-{expect}" / COMPLETE).is_file()
    capsys.readouterr()
    assert train_inproc(recipe, f"train.max_steps={expect + 1}", "distributed.engine=single") == 0
    assert f"step-{expect}" in capsys.readouterr().err
    assert [r["step"] for r in metrics(run_dir)][-1] == expect + 1


def test_a_rank_sleeping_in_a_collective_ends_the_job(tmp_path, capsys):
    recipe = _recipe(tmp_path, steps=6)
    done = torchrun(["train", str(recipe)], timeout=GUARD_S, env={"LLMFT_FAULT_INJECT": "sleep_in_collective:3:1"})
    assert done.returncode != 0, done.stderr[-4000:]
    # The sleeper's watchdog: no progress inside the all-reduce of step 3.
    sleeper = _gave_up(done.stderr, 1)
    assert re.match(
        rf"\[llmft rank 1\] rank 1: no progress for \d+ s \(distributed.timeout_s is {TIMEOUT_S}\)", sleeper
    )
    assert "it was in the all-reduce of the loss and stop vote (step 3), in the collective all_reduce" in sleeper
    _assert_stacks(sleeper)
    assert "in all_reduce_sum" in sleeper  # the sleeping frame, under the patched all-reduce
    # Its peer waited in the same all-reduce: its watchdog or the collective's timeout ended it.
    waiter = _gave_up(done.stderr, 0)
    assert "it was in the all-reduce of the loss and stop vote (step 3), in the collective all_reduce" in waiter
    _assert_stacks(waiter)
    _resume_from_last_checkpoint(recipe, tmp_path / "run", 2, capsys)


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of ``rank`` among the launcher's children (its RANK in /proc/PID/environ)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no rank {rank} among the children of {launcher}")


def test_a_rank_frozen_by_sigstop_ends_the_job(tmp_path, capsys):
    recipe = _recipe(tmp_path, steps=400)
    run_dir = tmp_path / "run"
    cmd = [*torchrun_cmd(2), *llmft_entry(), "train", str(recipe)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    frozen = None
    try:
        wait_for_step(run_dir, 3, proc)
        frozen = _rank_pid(proc.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass  # torchrun killed it, as it should
    assert proc.returncode != 0, err[-4000:]
    report = _gave_up(err, 0)
    assert re.match(r"\[llmft rank 0\] rank 0: (no progress for \d+ s|a collective failed)", report), report
    _assert_stacks(report)
    steps = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert steps and steps[-1] >= 2  # step 3 was logged; its checkpoint may be the one cut short
    _resume_from_last_checkpoint(recipe, run_dir, steps[-1], capsys)


def test_a_user_error_on_a_rank_is_reported_and_ends_the_job(tmp_path):
    """A user error found after the process group exists (here: data that does not parse, found by
    the rank that builds the cache) is printed as its one message, without a traceback of llmft's,
    and the rank leaves (leave_process) with the error's exit code; the launcher stops the other
    rank and the job ends non-zero instead of waiting."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": \n')
    recipe = _recipe(tmp_path, steps=2)
    done = torchrun(["train", str(recipe), f"data.train={data}", "data.eval=null"], timeout=GUARD_S)
    assert done.returncode != 0
    assert f"llmft train: error: {data}:2: not valid JSON" in done.stderr, done.stderr[-4000:]
    assert "exitcode  : 2" in done.stderr, done.stderr[-4000:]  # torchrun's summary: the error's own code
    package = str(ROOT / "llmft") + os.sep  # llmft's own code, not a checkout's folder of that name
    assert package not in "".join(line for line in done.stderr.splitlines() if line.lstrip().startswith("File ")), (
        done.stderr[-4000:]
    )
