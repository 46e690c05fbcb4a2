"""The test tiers are what docs/design.md ("Tests") says they are: tests/unit runs in the pytest
process. A unit test that starts a process (subprocess, torchrun, a fork, a multiprocessing pool)
belongs in tests/integration, or in tests/distributed when it starts several ranks. Read from
the source with ``ast``, so a word in a docstring or a string (``"torchrun.sh"``) is no hit.

No test anywhere measures wall-clock time to assert on it: a slow or busy machine must not fail
a test, and a fast one must not hide a regression. Tests assert what makes things fast instead
(which modules an import loaded, how many bytes were read)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

PROCESS_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing", "pty"}
PROCESS_CALLS = {
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.popen",
    "os.posix_spawn",
    "os.posix_spawnp",
    "os.execv",
    "os.execvp",
    "os.execve",
    "os.spawnv",
    "os.spawnl",
}
# tests/helpers.py functions that start processes
PROCESS_HELPERS = {"torchrun", "torchrun_cmd", "llmft_entry", "run_sharded_load_probe", "wait_for_step"}
CLOCKS = {
    "time.perf_counter",
    "time.perf_counter_ns",
    "time.process_time",
    "time.time",
    "time.time_ns",
    "time.monotonic",
    "time.monotonic_ns",
}


def _starts_processes(text: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text, name)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name in PROCESS_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            found += [f"{where} imports {n}" for n in sorted(names & PROCESS_MODULES)]
            if node.module == "helpers":
                found += [f"{where} uses helpers.{a.name}" for a in node.names if a.name in PROCESS_HELPERS]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in PROCESS_CALLS:
            found.append(f"{where} calls {ast.unparse(node.func)}")
    return found


def test_unit_tests_start_no_process():
    found = [
        hit
        for path in sorted((TESTS / "unit").glob("*.py"))
        for hit in _starts_processes(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    assert not found, "move these tests to tests/integration or tests/distributed:\n" + "\n".join(found)


def test_the_process_check_sees_imports_and_calls_not_strings():
    source = (
        "import subprocess\nfrom torch import multiprocessing\nfrom helpers import torchrun, write_recipe\n"
        "import os\nos.fork()\nx = 'torchrun --nproc_per_node 2'\n"
    )
    assert _starts_processes(source, "t.py") == [
        "t.py:1 imports subprocess",
        "t.py:2 imports torch.multiprocessing",
        "t.py:3 uses helpers.torchrun",
        "t.py:5 calls os.fork",
    ]


def _timed_asserts(text: str, name: str) -> list[str]:
    """Asserts on a duration: an ``assert`` on a difference of clock reads, or on a name computed
    from one in the same function (``took = time.perf_counter() - start``). A deadline (a clock
    read compared with ``start + limit``) is a timeout, not a measurement, and is fine."""

    def clock(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and ast.unparse(n.func) in CLOCKS for n in ast.walk(node))

    def duration(node: ast.AST, timed: set[str]) -> bool:
        return any(
            (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and (clock(n.left) or clock(n.right)))
            or (isinstance(n, ast.Name) and n.id in timed)
            for n in ast.walk(node)
        )

    found = []
    for func in ast.walk(ast.parse(text, name)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        timed: set[str] = set()
        for _ in range(2):  # names derived from names derived from a duration
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and duration(node.value, timed):
                    timed |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        found += [
            f"{name}:{node.lineno}"
            for node in ast.walk(func)
            if isinstance(node, ast.Assert) and duration(node.test, timed)
        ]
    return sorted(set(found))


def test_no_test_asserts_on_the_clock():
    found = [
        hit
        for path in sorted(TESTS.rglob("*.py"))
        for hit in _timed_asserts(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    # a timing taken in a child process and asserted in the test is text to this check: no test
    # has a reason to read the precise clock at all
    found += [
        str(path.relative_to(TESTS.parent))
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "test_tiers.py" and "perf_counter" in path.read_text()
    ]
    assert not found, "assert what makes it fast, not how long it took:\n" + "\n".join(found)


def test_the_clock_check_sees_a_timing_not_a_deadline():
    timing = "import time\ndef t():\n    start = time.perf_counter()\n    f()\n    took = time.perf_counter() - start\n    assert took < 1.0\n"
    deadline = (
        "import time\ndef t():\n    end = time.monotonic() + 5\n    while f():\n        assert time.monotonic() < end\n"
    )
    assert _timed_asserts(timing, "t.py") == ["t.py:6"]
    assert _timed_asserts(deadline, "t.py") == []
