"""What the recipe check (``plan/``) asks of the reward sandbox and the built-ins, without importing
any other llmft module (a leaf: ``tests/unit/test_architecture.py``): the built-ins' names and the
fields they read, and whether bubblewrap makes a sandbox on this machine."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

BUILTINS = ("math_verify", "code_tests")
# What each reads from a record, for messages and docs.
FIELDS = {"math_verify": "answer", "code_tests": "tests"}
SANDBOXED = ("code_tests",)  # those that run the completion's text as code: a sandbox or sandbox: none


INSTALL = "apt-get install bubblewrap"


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """None when bubblewrap runs a sandbox here; else why not (not installed, or the kernel refuses
    its namespaces: its own message). Tried once per process (~10 ms)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bwrap is not installed (not on PATH)"
    try:
        done = subprocess.run(
            [*bwrap_prefix(exe), "--ro-bind", "/", "/", "--", "/bin/true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{exe} does not run ({type(e).__name__}: {e})"
    if done.returncode != 0:
        said = (done.stderr or "").strip().splitlines()
        return f"{exe} cannot make a sandbox here ({said[-1] if said else f'exit {done.returncode}'})"
    return None


def bwrap_prefix(exe: str) -> list[str]:
    caps = ["--cap-drop", "ALL"] if os.geteuid() == 0 else []  # as root bwrap keeps them otherwise
    return [exe, "--die-with-parent", "--new-session", "--unshare-all", *caps]
