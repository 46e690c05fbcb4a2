"""The shape of llmft/data (docs/design.md, "Layers"): no module uses another module's private
(``_name``) names anywhere in llmft, no import cycle inside llmft/data even counting imports
inside functions, and a function-level import in llmft/data is a heavy third-party package whose
import is put off on purpose, with a comment that says why."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmft"
DATA = PACKAGE / "data"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of ``from <node.module> import ...`` written in ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) is not None:
        return f"{head}.{node.attr}"
    return None


def private_uses(source: str, module: str, is_package: bool = False) -> list[str]:
    """``from llmft.x import _name`` and ``llmft_x_module._name`` in ``source`` (the code of
    ``module``) where ``llmft.x`` is another module: one line per use."""
    tree = ast.parse(source)
    found = []
    aliases: dict[str, str] = {}  # local name -> the llmft module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = _absolute(node, module, is_package)
            if not origin.startswith("llmft"):
                continue
            for a in node.names:
                if _private(a.name) and origin != module:
                    found.append(f"{module}:{node.lineno} from {origin} import {a.name}")
                aliases[a.asname or a.name] = f"{origin}.{a.name}"  # a submodule, or a name (harmless)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("llmft"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            if head not in aliases:
                continue
            target = aliases[head] + (f".{rest}" if rest else "")
            if target != module:
                found.append(f"{module}:{node.lineno} {owner}.{node.attr} ({target})")
    return found


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def test_no_module_uses_another_modules_private_names():
    found = []
    for path in _files(PACKAGE):
        found += private_uses(path.read_text(), _module_name(path), path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_the_private_name_check_finds_both_kinds():
    code = (
        "import llmft.data.read as read\n"
        "from llmft.data import stream\n"
        "from llmft.data.rows import _Tokenize, build_rows\n"
        "from .read import _load_hub\n"
        "x = read._json_rows, stream._Reader, read.__doc__, self._mine\n"
    )
    assert private_uses(code, "llmft.data.build") == [
        "llmft.data.build:3 from llmft.data.rows import _Tokenize",
        "llmft.data.build:4 from llmft.data.read import _load_hub",
        "llmft.data.build:5 read._json_rows (llmft.data.read)",
        "llmft.data.build:5 stream._Reader (llmft.data.stream)",
    ]
    assert private_uses("from llmft.data.rows import _helper\n", "llmft.data.rows") == []


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports inside a function or class body (module level ones, TYPE_CHECKING included, are not)."""
    out = []
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out += [n for n in ast.walk(top) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    origin = _absolute(node, module, is_package)
    return [origin] + [f"{origin}.{a.name}" for a in node.names]


def _explained(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's own lines, or above the block of imports it belongs to (which
    may open with a commented ``try:``)."""
    if any("#" in line for line in lines[node.lineno - 1 : node.end_lineno]):
        return True
    above = node.lineno - 2
    while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
        if "#" in lines[above]:
            return True
        above -= 1
    return above >= 0 and "#" in lines[above]


def test_data_imports_llmft_at_module_level_and_says_why_it_puts_off_the_rest():
    """Function-level imports of llmft.* are not allowed in llmft/data (they hide cycles); a
    function-level import of a third-party package has a comment on its line or the line above."""
    found = []
    for path in _files(DATA):
        module, lines = _module_name(path), path.read_text().splitlines()
        for node in _function_imports(ast.parse(path.read_text())):
            names = _imported(node, module, path.name == "__init__.py")
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if any(n.split(".")[0] == "llmft" for n in names):
                found.append(f"{where} imports {names[0]} inside a function")
            elif not _explained(lines, node):
                found.append(f"{where} puts off importing {names[0]} without a comment saying why")
    assert not found, "\n".join(found)


def _data_graph() -> dict[str, set[str]]:
    """llmft.data module -> the llmft.data modules it imports anywhere (functions too; not TYPE_CHECKING)."""
    modules = {_module_name(p): p for p in _files(DATA)}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = {
            id(n)
            for top in tree.body
            if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
            for n in ast.walk(top)
        }
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for imported in _imported(node, name, path.name == "__init__.py"):
                    while imported and imported not in modules:
                        imported = imported.rpartition(".")[0]
                    if imported and imported != "llmft.data":
                        deps.add(imported)
        graph[name] = deps - {name}
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


def test_no_import_cycle_inside_data_counting_function_level_imports():
    graph = _data_graph()
    assert "llmft.data.stream" in graph and "llmft.data.rows" in graph["llmft.data.stream"]
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_data_is_at_most_six_import_levels_deep():
    """The longest chain of imports among llmft.data's modules (functions too; not TYPE_CHECKING) has
    at most six modules: a record kind is a module of its own (``kinds/``), not a level of the build."""
    graph = _data_graph()

    @functools.cache
    def depth(module: str) -> int:
        return 1 + max((depth(d) for d in graph[module]), default=0)

    deepest = max(graph, key=depth)
    chain = [deepest]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=depth))
    assert depth(deepest) <= 6, " -> ".join(chain)
