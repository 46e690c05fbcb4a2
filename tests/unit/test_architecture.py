"""The shape of the package (docs/design.md, "Layers"): no import cycles, every module imports on
its own, the compiler imports no torch, and the plan never imports the runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmft"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _top_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """llmft modules imported when ``path`` is imported (module level, not TYPE_CHECKING, not in functions)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node):
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.add(sub.module)
                found |= {f"{sub.module}.{a.name}" for a in sub.names}
    edges = set()
    for name in found:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("llmft"):
            edges.add(name)
    return edges


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # (importing a.b.c also runs a/__init__ and a/b/__init__ first; a package re-exporting its
        # own submodules is not a cycle, so those implicit edges are not drawn)
        graph[name] = _top_level_imports(path, modules) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_layers_point_one_way():
    """recipe/ never imports plan/ or the runtime; plan/ never imports the runtime (engines, run, loop...)."""
    graph = _graph()
    runtime = ("llmft.engines", "llmft.run", "llmft.train", "llmft.loop", "llmft.checkpoint.manager", "llmft.data")
    for name, deps in graph.items():
        if name.startswith("llmft.recipe"):
            assert not {d for d in deps if d.startswith(("llmft.plan", *runtime))}, name
        if name.startswith("llmft.plan"):
            assert not {d for d in deps if d.startswith(runtime)}, name


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


def test_each_module_imports_on_its_own():
    """Each module in a fresh interpreter state of llmft (forked after the third-party imports)."""
    modules = [m for m in sorted(_modules()) if m != "llmft.__main__"]  # __main__ runs the CLI
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *modules], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_compile_imports_no_torch(tmp_path):
    code = (
        "import sys\n"
        "from llmft.cli import main\n"
        f"assert main(['compile', 'configs/llama3-8b-lora-fsdp-8gpu.yaml', '--nproc-per-node', '8', '--out', r'{tmp_path}']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers', 'peft') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_functions_fit_on_a_screen_or_two():
    """docs/design.md: no function in llmft/ over 100 lines (the training loop reads top to bottom
    in one), and the path llmft train takes (train.py, run.py) none over 60."""
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        limit = 60 if path.name in ("train.py", "run.py") else 100
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not too_long, too_long
