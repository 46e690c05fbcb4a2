"""Every script the tests run as a rank leaves the way ``llmft train`` does: through
``llmft.job.dist.leave_process``, not the interpreter's teardown. A rank that finalizes the
interpreter with its gloo groups still alive (an engine keeps them referenced past
``destroy_process_group``) destroys them there, and a worker thread that takes the GIL back at that
moment aborts the process ("terminate called without an active exception", SIGABRT): a run that
passed reported as failed (docs/reliability.md#what-hung-and-what-aborted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _calls(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def _rank_scripts() -> dict[Path, set[str]]:
    """Probes (``*_probe.py``, run under torchrun) and test files whose functions join a group
    themselves (a ``torch.multiprocessing.spawn`` worker) -> the names each one calls."""
    out = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        calls = _calls(ast.parse(path.read_text()))
        if path.name.endswith("_probe.py") or {"init_process_group", "init_distributed"} & calls:
            out[path] = calls
    return out


def test_every_rank_script_leaves_through_leave_process():
    scripts = _rank_scripts()
    assert len(scripts) >= 10, [p.name for p in scripts]  # the probes and the spawn worker are found
    missing = [str(p.relative_to(ROOT)) for p, calls in scripts.items() if "leave_process" not in calls]
    assert not missing, "end these with llmft.job.dist.leave_process(code):\n" + "\n".join(missing)
