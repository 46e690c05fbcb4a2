"""The run-directory lock when its holder is killed (docs/reliability.md; the in-process cases are in
tests/unit/test_reliability.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from llmft.checkpoint.rundir import RunDirLock
from llmft.errors import UserError


def test_lock_of_a_killed_process_is_free(tmp_path):
    """flock dies with its process (kill -9 included): a requeued job is never blocked by a stale lock."""
    code = (
        "import os, sys, time; sys.path.insert(0, sys.argv[2]);"
        "from llmft.checkpoint.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); print('locked', flush=True);"
        "time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "run"), str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(UserError, match=f"pid {proc.pid}"):
        RunDirLock(tmp_path / "run").acquire()
    proc.kill()
    proc.wait()
    RunDirLock(tmp_path / "run").acquire().release()


def test_lock_of_a_killed_process_is_free_though_its_forked_child_lives_on(tmp_path):
    """kill -9 of the holder (the OOM killer) while a child it forked (a DataLoader worker) outlives
    it: the child never held the lock, so a requeued job gets it at once. (The parent reports the
    child once the child is past the fork, its at-fork handler run: on a loaded machine a child not
    yet scheduled still holds the inherited descriptor, and the test would race it.)"""

    code = (
        "import os, sys, time; sys.path.insert(0, sys.argv[2]);"
        "from llmft.checkpoint.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire();"
        "r, w = os.pipe(); child = os.fork()\n"
        "if child == 0:\n"
        "    os.write(w, b'1'); import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)\n"
        "    os._exit(0)\n"
        "os.read(r, 1); print(child, flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "run"), str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(UserError, match=f"pid {proc.pid}"):
            RunDirLock(tmp_path / "run").acquire()
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the child lives on
        RunDirLock(tmp_path / "run").acquire().release()
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)


# --- nothing waits forever ---------------------------------------------------------------------------


def _failing_loader_script(tmp_path: Path) -> Path:
    """A script whose loader's sampler raises once the workers are started (a bad resume position),
    uncaught, as ``llmft train`` meets it: the traceback keeps torch's half-made iterator alive."""
    script = tmp_path / "fail.py"
    script.write_text(
        "from llmft.data import make_loader\n"
        "class Broken:\n"
        "    def __iter__(self):\n"
        "        yield from range(None)  # raises at the first batch, after the workers started\n"
        "    def __len__(self):\n"
        "        return 1\n"
        "rows = [{'input_ids': [1, 2], 'labels': [1, 2], 'position_ids': None}] * 4\n"
        "iter(make_loader(rows, Broken(), 0, 1, 2))\n"
    )
    return script


def test_a_loader_that_fails_to_start_ends_the_process_with_its_error(tmp_path):
    """The workers ignore SIGTERM (llmft.data.workers); torch never handed the iterator back, so
    nothing shut them down and interpreter exit joined them forever."""
    done = subprocess.run(
        [sys.executable, str(_failing_loader_script(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith("TypeError: 'NoneType' object cannot be interpreted as an integer")
