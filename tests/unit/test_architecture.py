"""The shape of the package (docs/design.md, "Layers" and G9), read from the source with ``ast``.

The import graph holds every ``llmft`` import that can run: module-level and inside functions,
absolute and relative, and ``importlib.import_module("llmft...")`` with a literal name. Imports
under ``if TYPE_CHECKING:`` never run and are left out. Importing ``a.b.c`` also runs ``a`` and
``a.b`` first; those implicit edges are not drawn (a package re-exporting its own submodules is
not a cycle).

The rules:

- **No import cycles**, between modules and between the top-level units (a package such as
  checkpoint/ counted as one node: ``checkpoint/__main__ -> engines/deepspeed ->
  checkpoint/manager`` is a cycle). Every strongly connected component is reported, not just the
  first cycle found.
- **recipe/ and plan/ import nothing from the runtime.** The runtime is every module under
  llmft/ outside recipe/ and plan/, derived from the file tree, except a *leaf*: a module that
  imports nothing but the standard library (``llmft/errors.py``, ``llmft/__init__.py``). A leaf
  cannot pull the runtime in, so the layers may share it. recipe/ also imports nothing from
  plan/, and neither imports a HEAVY package (below), at any level.
- **No function-level ``llmft`` imports**, except in ``llmft/cli.py``: each subcommand imports
  its module when it runs, so ``llmft compile`` and ``llmft plan`` never load torch. Elsewhere a
  function-level import only hides a cycle or a layer break from a reader.
- **Function-level third-party imports only of HEAVY packages** (see ``HEAVY``). Standard-library
  imports may sit anywhere.
- **docs/design.md names every module** under llmft/ by its path below llmft/ (``data/stream.py``,
  a package as ``data/`` or ``data/__init__.py``) or its dotted name (``llmft.data.stream``).
- **Functions fit on a screen or two** (100 lines; 60 in train.py and run.py).

Each module importing on its own and ``llmft compile`` importing no torch need a fresh
interpreter: tests/integration/test_imports.py holds them.

``python tests/unit/test_architecture.py`` prints a report: cycles, function-level llmft imports
per module, engine-name string literals outside llmft/plan/engines.py, modules docs/design.md
does not name, layer breaks, function-level imports of light third-party packages, and
``"llmft.module:attribute"`` strings (code a registry loads lazily: not an import, so not in the
graph, listed so a reader sees where they point).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmft"
DESIGN = ROOT / "docs" / "design.md"

# Imported inside the function that needs them because each costs a second or more to import
# (or pulls CUDA/native libraries), and `llmft compile`, `llmft plan`, `--help` must not pay that.
HEAVY = frozenset(
    {
        "torch",
        "deepspeed",
        "transformers",
        "peft",
        "bitsandbytes",
        "accelerate",
        "datasets",
        "pyarrow",
        "numpy",
        "safetensors",
        "huggingface_hub",
        "tokenizers",
        "matplotlib",
        "tqdm",
        "wandb",
        "mlflow",
        "tensorboard",
        "liger_kernel",
        "flash_attn",
        "triton",
        "kernels",  # optional: the Hub kernels package, absent unless installed
        "vllm",  # optional: rollout.backend vllm (seconds to import; not installed beside the suite)
        "math_verify",  # optional: the math_verify reward (the rewards extra)
    }
)
# The only module whose functions may import llmft modules (one import per subcommand).
LAZY_LLMFT_ALLOWED = frozenset({"llmft.cli"})
ENGINE_NAMES = frozenset({"single", "ddp", "fsdp", "deepspeed"})
ENGINE_REGISTRY = "llmft/plan/engines.py"
DOTTED = re.compile(r"llmft(\.\w+)+:\w+")


@dataclass(frozen=True)
class Import:
    target: str  # an llmft module name, or a third-party top-level package
    line: int
    in_function: bool
    llmft: bool


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """The llmft module that ``name`` (a module or an attribute of one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


class _ImportFinder(ast.NodeVisitor):
    def __init__(self, name: str, path: Path, modules: dict[str, Path], type_only: bool = False):
        self.modules = modules
        self.type_only = type_only  # also the imports under ``if TYPE_CHECKING:`` (annotations)
        # the package relative imports start from
        self.package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        self.depth = 0  # > 0 inside a function body
        self.found: list[Import] = []

    def _add(self, dotted: str, line: int) -> None:
        top = dotted.partition(".")[0]
        if top == "llmft":
            module = _owning_module(dotted, self.modules)
            if module:
                self.found.append(Import(module, line, self.depth > 0, True))
        elif top not in sys.stdlib_module_names and top != "__future__":
            self.found.append(Import(top, line, self.depth > 0, False))

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test) and not self.type_only:
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            # `from llmft.data import stream` imports the module llmft.data.stream
            self._add(f"{module}.{alias.name}" if module.startswith("llmft") else module, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = ast.unparse(node.func)
        if func in ("importlib.import_module", "import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._add(first.value, node.lineno)
        self.generic_visit(node)


def _imports(modules: dict[str, Path] | None = None, type_only: bool = False) -> dict[str, list[Import]]:
    modules = modules or _modules()
    out = {}
    for name, path in modules.items():
        finder = _ImportFinder(name, path, modules, type_only)
        finder.visit(ast.parse(path.read_text(), str(path)))
        out[name] = list(dict.fromkeys(finder.found))  # `from m import a, b` is one import of m
    return out


def _graph(imports: dict[str, list[Import]] | None = None) -> dict[str, set[str]]:
    imports = imports if imports is not None else _imports()
    return {name: {i.target for i in found if i.llmft} - {name} for name, found in imports.items()}


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the top-level units of llmft: a package (checkpoint/, data/, ...) is one
    node, a top-level module another; the package ``llmft`` itself is left out."""

    def unit(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        if name != "llmft":
            out.setdefault(unit(name), set()).update(unit(d) for d in deps if d != "llmft" and unit(d) != unit(name))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle inside ``component``, for the message (a -> b -> a)."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nexts = sorted(graph[path[-1]] & members)
        back = [n for n in nexts if n in seen]
        if back:
            return path[path.index(back[0]) :] + [back[0]]
        path.append(nexts[0])
        seen.add(nexts[0])


def _describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    return [f"{{{', '.join(c)}}}: {' -> '.join(_cycle_path(graph, c))}" for c in _cycles(graph)]


def _is_leaf(found: list[Import]) -> bool:
    return not [i for i in found if not (i.llmft and i.target == "llmft")]


def _upper_layer(name: str) -> str | None:
    for layer in ("llmft.recipe", "llmft.plan"):
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def _layer_breaks(imports: dict[str, list[Import]]) -> list[str]:
    runtime = {name for name, found in imports.items() if not _upper_layer(name) and not _is_leaf(found)}
    breaks = []
    for name, found in sorted(imports.items()):
        layer = _upper_layer(name)
        if not layer:
            continue
        for i in found:
            where = f"{name}:{i.line}{' (in a function)' if i.in_function else ''}"
            if i.llmft and i.target in runtime:
                breaks.append(f"{where} imports the runtime module {i.target}")
            elif i.llmft and layer == "llmft.recipe" and _upper_layer(i.target) == "llmft.plan":
                breaks.append(f"{where} imports {i.target}: recipe/ knows nothing of plans")
            elif not i.llmft and i.target in HEAVY:
                breaks.append(f"{where} imports {i.target}")
    return breaks


def _function_level_llmft(imports: dict[str, list[Import]]) -> dict[str, list[Import]]:
    out = {}
    for name, found in sorted(imports.items()):
        lazy = [i for i in found if i.llmft and i.in_function]
        if lazy and name not in LAZY_LLMFT_ALLOWED:
            out[name] = lazy
    return out


def _light_function_level(imports: dict[str, list[Import]]) -> list[str]:
    return [
        f"{name}:{i.line} imports {i.target}"
        for name, found in sorted(imports.items())
        for i in found
        if not i.llmft and i.in_function and i.target not in HEAVY
    ]


def _named_in(text: str, name: str, path: Path) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    spellings = [rel, f"llmft.{name.removeprefix('llmft.')}" if name != "llmft" else "llmft/__init__.py"]
    if path.name == "__init__.py" and rel != "__init__.py":
        spellings.append(rel.removesuffix("__init__.py"))
    for spelling in spellings:
        # a whole name: `verify.py` is not named by `checkpoint/verify.py`
        if re.search(r"(?:(?<![\w/.])|(?<=llmft/))" + re.escape(spelling) + r"(?![\w/])", text):
            return True
    return False


def _missing_from_design(modules: dict[str, Path] | None = None) -> list[str]:
    modules = modules or _modules()
    text = DESIGN.read_text()
    return [path.relative_to(ROOT).as_posix() for name, path in modules.items() if not _named_in(text, name, path)]


def _engine_literals() -> Counter[str]:
    """Files under llmft/ (outside the engine registry) -> count of bare engine-name strings."""
    counts: Counter[str] = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == ENGINE_REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ENGINE_NAMES:
                counts[rel] += 1
    return counts


def _dotted_references() -> list[str]:
    """``"llmft.module:attribute"`` strings (a registry's lazily loaded code): not imports, so not in
    the graph, but where they point matters to a reader of the layers."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.value}")
    return found


def _long_functions() -> list[str]:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        limit = 60 if path.name in ("train.py", "run.py") else 100
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return too_long


# --- the checks -------------------------------------------------------------------------------


def test_no_import_cycles():
    cycles = _describe_cycles(_graph())
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(cycles)


def test_no_import_cycles_between_packages():
    """checkpoint/ -> engines/ -> checkpoint/ is a cycle even when no module is on it twice."""
    cycles = _describe_cycles(_package_graph(_graph()))
    assert not cycles, f"{len(cycles)} import cycle(s) between packages:\n" + "\n".join(cycles)


def test_no_import_cycles_through_type_only_imports():
    """An import under ``if TYPE_CHECKING:`` never runs, but a module that names a type of the
    module importing it is a circle a reader follows all the same: none between modules."""
    cycles = _describe_cycles(_graph(_imports(type_only=True)))
    assert not cycles, f"{len(cycles)} import cycle(s) through type-only imports:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_every_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert _cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_relative_and_importlib_imports(tmp_path):
    pkg = tmp_path / "llmft"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from llmft.sub import b\n    import torch\n")
    (pkg / "sub" / "b.py").write_text(
        "import importlib\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmft import c\n"
        "def g():\n    return importlib.import_module('llmft.a')\nfrom ..c import X\n"
    )
    (pkg / "c.py").write_text("X = 1\n")
    modules = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(tmp_path).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = _imports(modules)
    assert _graph(imports) == {
        "llmft": set(),
        "llmft.a": {"llmft.sub.b"},
        "llmft.c": set(),
        "llmft.sub": {"llmft.sub.b"},
        "llmft.sub.b": {"llmft.a", "llmft.c"},
    }
    assert _cycles(_graph(imports)) == [["llmft.a", "llmft.sub.b"]]
    assert [(i.target, i.in_function) for i in imports["llmft.a"]] == [("llmft.sub.b", True), ("torch", True)]


def test_layers_point_one_way():
    breaks = _layer_breaks(_imports())
    assert not breaks, "\n".join(breaks)


def test_no_function_level_llmft_imports_outside_the_cli():
    lazy = _function_level_llmft(_imports())
    lines = [f"{name}:{i.line} imports {i.target}" for name, found in lazy.items() for i in found]
    assert not lines, f"{len(lines)} function-level llmft import(s):\n" + "\n".join(lines)


def test_function_level_third_party_imports_are_heavy_ones():
    light = _light_function_level(_imports())
    assert not light, "import these at the top of the module:\n" + "\n".join(light)


def test_design_names_every_module():
    missing = _missing_from_design()
    assert not missing, "docs/design.md does not name:\n" + "\n".join(missing)


def test_functions_fit_on_a_screen_or_two():
    """No function in llmft/ over 100 lines (the training loop reads top to bottom in one), and
    on the path llmft train takes (train.py, run.py) none over 60."""
    too_long = _long_functions()
    assert not too_long, too_long


# --- the report -------------------------------------------------------------------------------


def report() -> str:
    modules = _modules()
    imports = _imports(modules)
    graph = _graph(imports)
    edges = [i for found in imports.values() for i in found if i.llmft and i.target != "llmft"]
    lines = [
        f"modules under llmft/: {len(modules)}",
        f"llmft imports: {len(edges)} ({sum(i.in_function for i in edges)} inside functions)",
        "",
    ]
    cycles = _describe_cycles(graph)
    lines += [f"import cycles (strongly connected components): {len(cycles)}", *[f"  {c}" for c in cycles], ""]
    cycles = _describe_cycles(_package_graph(graph))
    lines += [f"import cycles between packages and top-level modules: {len(cycles)}", *[f"  {c}" for c in cycles], ""]
    breaks = _layer_breaks(imports)
    lines += [f"layer breaks (recipe/, plan/): {len(breaks)}", *[f"  {b}" for b in breaks], ""]
    lazy = _function_level_llmft(imports)
    lines.append(f"function-level llmft imports outside llmft/cli.py: {sum(map(len, lazy.values()))}")
    for name, found in lazy.items():
        lines.append(f"  {name} ({len(found)}): " + ", ".join(f"{i.target}:{i.line}" for i in found))
    light = _light_function_level(imports)
    lines += ["", f"function-level imports of packages outside HEAVY: {len(light)}", *[f"  {x}" for x in light], ""]
    literals = _engine_literals()
    lines.append(
        f"engine-name string literals outside {ENGINE_REGISTRY}: {sum(literals.values())} in {len(literals)} files"
    )
    lines += [f"  {path}: {n}" for path, n in sorted(literals.items())]
    missing = _missing_from_design(modules)
    lines += ["", f"modules docs/design.md does not name: {len(missing)} of {len(modules)}"]
    lines += [f"  {m}" for m in missing]
    dotted = _dotted_references()
    lines += ["", f"'llmft.module:attribute' strings (loaded lazily, not in the graph): {len(dotted)}"]
    lines += [f"  {d}" for d in dotted]
    too_long = _long_functions()
    lines += ["", f"functions over the length limit: {len(too_long)}", *[f"  {x}" for x in too_long]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
