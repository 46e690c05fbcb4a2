"""The built-in rewards (``{builtin: NAME, weight}`` in ``rewards``); each column is named NAME.

- ``math_verify``: 1.0 when the completion's final answer equals the record's ``answer`` field by
  the ``math-verify`` package (``pip install "llmft[rewards]"``): LaTeX or plain expressions,
  ``\\boxed{}`` preferred, so ``\\boxed{1/2}`` matches ``0.5``; else 0.0. The answer is read as it is,
  else as LaTeX (``\\frac12``); None (no opinion) when it does not parse (TRL's ``accuracy_reward``
  does the same).
- ``code_tests``: the completion's code (its last fenced ```python block, else the whole completion)
  run against the record's ``tests``: a string of Python (asserts) or a list of such strings. Each
  test runs in its own process: the code, then the test, in one namespace; it passes when it runs
  to its end (no exception, no exit before it). The reward is the fraction of the tests that pass
  (a string: 1.0 or 0.0). Each process runs in the ``strict`` bubblewrap sandbox
  (``llmft.scoring.sandbox``: no network, the file system read-only, home directories hidden, an
  empty environment, a private ``/tmp``) unless the entry says ``sandbox: none``, and under
  ``resource`` limits: ``CODE_TESTS_MEMORY_BYTES`` of address space, ``CODE_TESTS_FILE_BYTES`` per
  file written, and ``CODE_TESTS_TEST_S`` seconds of wall and CPU time (less when
  ``rewards[].timeout_s`` shared among the record's tests is less). The code runs in the same
  interpreter as its test: the sandbox bounds what it can reach, not how it might game its own
  test.

Both read what the record holds and raise (stopping the run, naming the record) when the field
they need is missing.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable

from llmft.limits import (
    CODE_TESTS_FILE_BYTES,
    CODE_TESTS_MAX_TESTS,
    CODE_TESTS_MEMORY_BYTES,
    CODE_TESTS_TEST_S,
)
from llmft.scoring.probe import BUILTINS, FIELDS, SANDBOXED  # noqa: E402,F401 - the plan reads them there
from llmft.scoring.sandbox import bwrap_argv, kill_tree


def make_builtin(name: str, timeout_s: float | None = None, sandbox: str = "bwrap") -> Callable[..., Any]:
    """The reward function of built-in ``name`` (``BUILTINS``). ``timeout_s``: its call's deadline
    (code_tests shares it among a record's tests); ``sandbox``: code_tests' ``bwrap`` or ``none``."""
    if name == "math_verify":
        return math_verify
    if name == "code_tests":

        def code_tests(prompt: Any, completion: str, **fields: Any) -> float:
            return run_code_tests(completion, fields, timeout_s, sandbox)

        code_tests.__wrapped__ = run_code_tests  # type: ignore[attr-defined]  # its file:line in messages
        return code_tests
    raise ValueError(f"no built-in reward {name!r}")


def _field(fields: dict[str, Any], name: str, reward: str) -> Any:
    if name not in fields:
        have = ", ".join(sorted(fields)) or "none"
        raise ValueError(f"{reward} reads the record's {name!r} field, which this record lacks (its fields: {have})")
    return fields[name]


def math_verify(prompt: Any, completion: str, **fields: Any) -> float | None:
    """1.0 when the completion's final answer equals the record's ``answer`` (math-verify), else 0.0;
    None when the answer does not parse."""
    from math_verify import parse, verify  # the rewards extra

    answer = str(_field(fields, "answer", "math_verify"))
    gold = parse(answer) or parse(f"${answer}$")  # bare LaTeX (\\frac12) parses inside math delimiters
    if not gold:
        return None
    return 1.0 if verify(gold, parse(completion)) else 0.0


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def completion_code(completion: str) -> str:
    """The last fenced code block (```python, ```py or plain ```), else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _tests(fields: dict[str, Any]) -> list[str]:
    tests = _field(fields, "tests", "code_tests")
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"code_tests needs the record's 'tests' as a string or a list of strings, not {tests!r:.80}")
    if len(tests) > CODE_TESTS_MAX_TESTS:
        raise ValueError(f"the record has {len(tests)} tests; code_tests runs at most {CODE_TESTS_MAX_TESTS}")
    return tests


def run_code_tests(completion: str, fields: dict[str, Any], timeout_s: float | None, sandbox: str) -> float:
    """The fraction of the record's tests the completion's code passes (module docstring)."""
    tests, code = _tests(fields), completion_code(completion)
    seconds = CODE_TESTS_TEST_S if timeout_s is None else min(CODE_TESTS_TEST_S, timeout_s / (len(tests) + 1))
    return sum(run_test(code, t, seconds, sandbox) for t in tests) / len(tests)


# Runs in the test's process (``python -I -c``): the limits, then the code and the test in one
# namespace, then the nonce, which the trainer's side checks: exiting early never passes.
_RUNNER = """
import json, resource, sys
job = json.loads(sys.stdin.read())
for which, value in ((resource.RLIMIT_AS, job["memory"]), (resource.RLIMIT_FSIZE, job["file"]),
                     (resource.RLIMIT_CPU, job["cpu"]), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(which, (value, value))
scope = {"__name__": "__main__"}
exec(compile(job.pop("code"), "<completion>", "exec"), scope)
exec(compile(job.pop("test"), "<test>", "exec"), scope)
sys.stdout.flush()
sys.stdout.write("\\n" + job["nonce"] + "\\n")
sys.stdout.flush()
"""


def run_test(code: str, test: str, seconds: float, sandbox: str) -> float:
    """1.0 when ``code`` then ``test`` run to their end in a confined process within ``seconds``, else 0.0."""
    nonce = secrets.token_hex(16)
    job = json.dumps(
        {
            "code": code,
            "test": test,
            "nonce": nonce,
            "memory": CODE_TESTS_MEMORY_BYTES,
            "file": CODE_TESTS_FILE_BYTES,
            "cpu": max(1, math.ceil(seconds)),
        }
    ).encode()
    cmd = [sys.executable, "-I", "-c", _RUNNER]
    tmpdir = None
    if sandbox == "bwrap":
        argv, env, cwd = [*bwrap_argv("strict"), *cmd], None, None
    else:
        tmpdir = tempfile.mkdtemp(prefix="llmft-code-")
        argv, cwd = cmd, tmpdir
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmpdir, "TMPDIR": tmpdir, "LANG": "C.UTF-8"}
    # stdout to a file: RLIMIT_FSIZE bounds what the test can print, as any file it writes
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True
        )
        try:
            proc.communicate(job, timeout=seconds)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_tree(proc)  # what it left running dies with it
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
        out.seek(max(0, os.fstat(out.fileno()).st_size - 256))
        tail = out.read().decode(errors="replace").split()
    return 1.0 if proc.returncode == 0 and tail and tail[-1] == nonce else 0.0
