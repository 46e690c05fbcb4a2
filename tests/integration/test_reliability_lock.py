"""The run-directory lock when its holder is killed (docs/reliability.md; the in-process cases are in
tests/unit/test_reliability.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

from llmft.errors import UserError
from llmft.rundir import RunDirLock


def test_lock_of_a_killed_process_is_free(tmp_path):
    """flock dies with its process (kill -9 included): a requeued job is never blocked by a stale lock."""
    code = (
        "import os, sys, time; sys.path.insert(0, sys.argv[2]);"
        "from llmft.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); print('locked', flush=True);"
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
