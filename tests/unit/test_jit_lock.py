"""A JIT build lock left by a killed build (torch's FileBaton, which DeepSpeed's CPU communication op
takes in every process) is named with the fix before DeepSpeed waits on it forever; a lock a live
process holds open (a build in progress) is not (llmft/engines/deepspeed.py, docs/preference.md)."""

from __future__ import annotations

import logging
import os

from llmft.engines.deepspeed import warn_stale_build_locks


def test_a_lock_no_process_holds_is_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert warn_stale_build_locks() == []
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.write_text("")
    with caplog.at_level(logging.WARNING, logger="llmft"):
        assert warn_stale_build_locks() == [lock]
    assert (
        f"{lock} exists but no process on this machine has it open: a JIT build of deepspeed_shm_comm was "
        f"killed while holding it, and DeepSpeed waits for it forever; if no other machine builds into this "
        f"directory, remove it (rm {lock})" in caplog.text
    )
    fd = os.open(lock, os.O_RDONLY)  # a live holder: a build in progress
    try:
        assert warn_stale_build_locks() == []
    finally:
        os.close(fd)
