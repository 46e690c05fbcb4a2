"""The bubblewrap sandbox of reward workers and of code_tests' test processes, and killing a process
with everything it started.

Two profiles, one command line each (``bwrap_argv``):

- ``worker`` (a reward function's worker): the whole file system read-only (``--ro-bind / /``), a
  private ``/tmp`` (a tmpfs of ``REWARD_WORKER_TMP_BYTES``, also ``TMPDIR``; the trainer's working
  directory and ``sys.path`` entries under ``/tmp`` bound back into it read-only), a fresh ``/dev`` and
  ``/proc``, no network and its own pid, ipc and uts namespaces (``--unshare-all``), its own session
  (``--new-session``: no ioctl on the trainer's terminal), no capabilities, and it dies with the
  process that started it (``--die-with-parent``). The environment is the trainer's: the function
  is the user's own code, confined so that it cannot write, reach the network or outlive its call.
- ``strict`` (one test of a code_tests completion, code the model wrote): as ``worker``, and the
  home directories (``$HOME``, ``/root``, ``/home``) hidden under empty tmpfs (the interpreter's
  own directories bound back read-only), an empty environment but ``PATH``, ``HOME=/tmp``,
  ``TMPDIR`` and ``LANG``, and a smaller ``/tmp`` (``CODE_TESTS_TMP_BYTES``).

Killing the outer ``bwrap`` process kills the sandbox: its init (pid 1 of the new pid namespace)
dies with its parent, and the kernel kills every process of a pid namespace whose init died,
whatever session or group they moved to.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from llmft.limits import CODE_TESTS_TMP_BYTES, REWARD_WORKER_TMP_BYTES
from llmft.scoring.probe import bwrap_prefix

# llmft's own package (the worker runs llmft.scoring.worker): an editable install under /tmp is found
# by its finder, not through a sys.path entry
LLMFT_DIR = str(Path(__file__).resolve().parents[1])


def _hidden_homes() -> list[str]:
    """The home directories a strict sandbox hides (those that exist, outermost first)."""
    homes = {os.environ.get("HOME", ""), "/root", "/home"}
    found = sorted({str(Path(h).resolve()) for h in homes if h and os.path.isdir(h)}, key=len)
    out: list[str] = []
    for h in found:  # /home/u under /home is hidden already
        if h != "/" and not any(h == o or h.startswith(o + "/") for o in out):
            out.append(h)
    return out


def _interpreter_dirs() -> list[str]:
    """The directories the interpreter needs to start (the venv, the base install, the binary's own)."""
    exe_dir = str(Path(os.path.realpath(sys.executable)).parent.parent)
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, exe_dir}
    return sorted({str(Path(d).resolve()) for d in dirs if d and os.path.isdir(d)})


def bwrap_argv(profile: str, cwd: str | None = None, visible: tuple[str, ...] = ()) -> list[str]:
    """The ``bwrap ... --`` prefix of a command in the sandbox ``profile`` (``worker`` | ``strict``,
    module docstring), started in ``cwd`` (``/tmp`` when None). The interpreter's directories that lie
    under ``/tmp`` and, for a ``worker``, ``cwd`` and the directories ``visible`` (the trainer's
    ``sys.path``) are bound into the private one read-only, so that the reward's module and the files it reads next to the run are
    where they were."""
    exe = shutil.which("bwrap")
    assert exe is not None, "bwrap_argv without bwrap: bwrap_problem() says why"
    argv = [*bwrap_prefix(exe), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    tmp_bytes = REWARD_WORKER_TMP_BYTES
    if profile == "strict":
        tmp_bytes = CODE_TESTS_TMP_BYTES
        homes = _hidden_homes()
        for home in homes:
            argv += ["--tmpfs", home]
        for d in _interpreter_dirs():
            if any(d == h or d.startswith(h + "/") for h in homes):
                argv += ["--ro-bind", d, d]
        argv += ["--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
        argv += ["--setenv", "LANG", "C.UTF-8"]
    argv += ["--size", str(tmp_bytes), "--tmpfs", "/tmp", "--setenv", "TMPDIR", "/tmp"]
    # what the private /tmp hides and the process needs: the interpreter (a venv under /tmp), and a
    # worker's module and working directory
    wanted = (*visible, cwd or "", LLMFT_DIR) if profile == "worker" else ()
    shown = {str(Path(d).resolve()) for d in (*wanted, *_interpreter_dirs()) if d and os.path.isdir(d)}
    for d in sorted(x for x in shown if x.startswith("/tmp/")):
        argv += ["--ro-bind", d, d]
    return [*argv, "--chdir", cwd or "/tmp", "--"]


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children, theirs, ...), read from /proc; [] where there is none."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state, ppid, pgrp, session, ...
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (started with ``start_new_session``), its process group and every process it
    started, then reap it. A bwrap sandbox dies whole with it (module docstring)."""
    below = descendants(proc.pid) if proc.poll() is None else []
    for target in (-proc.pid, proc.pid, *below):  # the group first: a fork racing the walk is in it
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: reaped when it wakes
        pass
