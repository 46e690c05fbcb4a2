"""The import check of docs/design.md G9 that needs a fresh interpreter: every module imports on
its own (the static checks are in tests/unit/test_architecture.py; `llmft compile` and `llmft plan`
loading no torch in tests/integration/test_compile_cli.py and test_plan_cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmft"

_IMPORT_EACH = """
import importlib, os, sys, traceback
for heavy in ("torch", "transformers", "peft", "numpy", "omegaconf", "safetensors"):
    importlib.import_module(heavy)  # third-party imports are shared; every llmft module is imported alone
failed = []
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc()[-1500:].encode())
            os._exit(1)
    os.close(write)
    message = os.read(read, 4096).decode()
    os.close(read)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(module + ": " + message)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_each_module_imports_on_its_own():
    """Each module in a fresh interpreter state of llmft (forked after the third-party imports)."""
    modules = [m for m in _modules() if m != "llmft.__main__"]  # __main__ runs the CLI
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *modules], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_plan_layer_imports_no_torch():
    """Every module of recipe/ and plan/ (the engine registry, the resolver, the memory planner,
    the compilers) together load no torch."""
    modules = [m for m in _modules() if m.startswith(("llmft.recipe", "llmft.plan"))]
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
