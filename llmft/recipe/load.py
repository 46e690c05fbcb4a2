"""Read a recipe: YAML file (or compiled dir) + ``key=value`` overrides -> a checked ``Recipe``.

Problems are collected, not raised one by one: a recipe with a typo, a wrong
type and a bad batch reports all three at once, each with where it came from
(``file:line`` or the override) and how to fix it.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmft.errors import Problem, UserError
from llmft.limits import RECIPE_MAX_BYTES, RECIPE_MAX_DEPTH
from llmft.recipe.schema import Recipe, iter_fields
from llmft.recipe.sections import MODULE_KEY, builtin_sections, import_module, recipe_class
from llmft.recipe.validate import check_combinations, check_values

FREE_FORM = {"model.config"}  # values that are arbitrary mappings, not schema sections
RECIPE_FILE = "recipe.yaml"
# An override's key: dotted names, each optionally indexed (``data.train[0].weight``).
_KEY = re.compile(r"[\w-]+(\[\d+\])?(\.[\w-]+(\[\d+\])?)*")
# A resolver call inside ``${...}``; only the environment is read, nothing else is evaluated.
_RESOLVER = re.compile(r"\$\{\s*([^${}:\s]+)\s*:")
ALLOWED_RESOLVERS = ("oc.env",)


# What OmegaConf's merge raises for a value of the wrong shape besides its own errors: a mapping
# into a list (TypeError), an int too large for a float key (OverflowError).
_MERGE_ERRORS = (OmegaConfBaseException, TypeError, ValueError, OverflowError)


class RecipeError(UserError):
    pass


class _Sources:
    """Where each dotted key was set: ``file:line`` or ``override 'k=v'``."""

    def __init__(self) -> None:
        self.where: dict[str, str] = {}

    def of(self, key: str) -> str:
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            got = self.where.get(".".join(parts[:n]))
            if got:
                return f"{got}: {key}"
        # A section only named inside a longer key (``foo.bar=1`` makes the unknown ``foo``).
        got = next((w for k, w in self.where.items() if k.startswith(key + ".")), None)
        return f"{got}: {key}" if got else key


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _line_map(root: yaml.Node | None, filename: str, sources: _Sources) -> None:
    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                sources.where[key] = f"{filename}:{k.start_mark.line + 1}"
                walk(v, key + ".")

    walk(root, "")


def resolve_recipe_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    try:
        p.stat()
    except FileNotFoundError:
        pass  # reported below
    except OSError as e:  # a name too long, a loop of links, no permission on a parent
        raise RecipeError(Problem(str(p), f"cannot be read ({e.strerror or e})", "Check the path.")) from None
    if p.is_dir():
        if (p / RECIPE_FILE).is_file():
            return p / RECIPE_FILE
        raise RecipeError(
            Problem(
                str(p),
                f"is a directory without a {RECIPE_FILE}",
                "Pass a recipe YAML file or a directory written by `llmft compile`.",
            )
        )
    if not p.is_file():
        raise RecipeError(
            Problem(str(p), "recipe file not found", "Check the path; configs/ holds complete example recipes.")
        )
    return p


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise RecipeError(
            Problem(
                f"{path}:{line}",
                f"is not UTF-8 text (byte 0x{data[e.start]:02x} at column {column})",
                "Save the recipe as UTF-8 (most editors: File > Save with encoding).",
            )
        ) from None


def _too_deep(text: str, limit: int) -> yaml.Mark | None:
    """Where YAML ``text`` first opens a mapping or list nested more than ``limit`` levels deep, or
    None. The parser's events are counted (PyYAML's parser keeps a stack, its composer and OmegaConf
    recurse): a RecursionError is never reached. Raises ``yaml.YAMLError`` for text that is not YAML."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > limit:
                return event.start_mark
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return None


_TOO_DEEP_FIX = (
    "Recipe sections nest a few levels (section: key: value; model.config a HF config's few more): "
    "remove the extra brackets or indentation"
)


def _read_yaml(path: Path, sources: _Sources) -> DictConfig:
    try:
        with open(path, "rb") as f:
            data = f.read(RECIPE_MAX_BYTES + 1)
    except OSError as e:
        raise RecipeError(
            Problem(str(path), f"cannot be read: {e.strerror or e}", "Check the file's permissions.")
        ) from None
    if len(data) > RECIPE_MAX_BYTES:
        raise RecipeError(
            Problem(
                str(path),
                f"is larger than the {RECIPE_MAX_BYTES >> 20} MiB a recipe may be",
                "Check that this is the recipe file; a recipe is a few KB of YAML.",
            )
        )
    text = _decode(data, path)
    try:
        # Nesting first (events only, nothing recurses), then the node tree (nothing is
        # constructed): a document that is not a mapping is a message, not OmegaConf's assertion.
        # OmegaConf then loads with a SafeLoader: a tag never constructs an object.
        mark = _too_deep(text, RECIPE_MAX_DEPTH)
        if mark is not None:
            raise RecipeError(
                Problem(
                    f"{path}:{mark.line + 1}:{mark.column + 1}",
                    f"nests mappings and lists more than {RECIPE_MAX_DEPTH} levels deep",
                    _TOO_DEEP_FIX + ".",
                )
            )
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and not isinstance(root, yaml.MappingNode):
            raise RecipeError(
                Problem(str(path), "a recipe must be a YAML mapping of sections (run:, model:, data: ...)")
            )
        cfg = OmegaConf.create(text) if root is not None else OmegaConf.create({})
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = getattr(e, "problem", None) or _first_line(e)
        raise RecipeError(
            Problem(
                where,
                f"YAML syntax error: {what}",
                "Fix the YAML at that line (indentation, a missing ':' or an unclosed quote).",
            )
        ) from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise RecipeError(Problem(str(path), f"a number in it cannot be read: {e}", "Shorten that number.")) from None
    _line_map(root, str(path), sources)
    return cfg


def _parse_override(item: str) -> tuple[str, Any, Problem | None]:
    """``(key, value, None)`` or ``(key, None, the problem)`` for one ``KEY=VALUE``."""
    where = f"override {item!r}"
    key = item.partition("=")[0].strip()
    if "=" not in item or not _KEY.fullmatch(key):
        return key, None, Problem(where, "is not KEY=VALUE with a dotted key", "Write e.g. optim.lr=1e-4.")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:
        return (
            key,
            None,
            Problem(where, "is not UTF-8 text", "Type the override again, or set the value in the recipe."),
        )
    levels = len(re.split(r"[.\[]", key))  # the key's parts are levels of the recipe, as in a file
    try:
        too_deep = _too_deep(item.partition("=")[2], RECIPE_MAX_DEPTH - levels) is not None
    except yaml.YAMLError:
        too_deep = False  # not YAML: said below
    if too_deep:
        what = f"nests mappings and lists more than {RECIPE_MAX_DEPTH} levels deep (its key counts {levels})"
        return key, None, Problem(where, what, _TOO_DEEP_FIX + " from the value.")
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    except yaml.YAMLError as e:
        what = getattr(e, "problem", None) or _first_line(e)
        fix = f"Quote the value ({key}='...') if it is text, or close its brackets."
        return key, None, Problem(where, f"the value is not valid YAML ({what})", fix)
    except OmegaConfBaseException as e:
        return key, None, Problem(where, f"cannot be parsed: {_first_line(e)}", "Use a number, text or a list.")
    except ValueError:  # an integer of more digits than Python converts
        return key, None, Problem(f"{where}: {key}", "the number has more than 4300 digits", "Use a smaller number.")
    for _ in re.split(r"[.\[]", key):  # one single-key mapping per part of the key, as OmegaConf spelled it
        value = next(iter(value.values())) if isinstance(value, dict) and value else value
    return key, value, None


def _parse_overrides(overrides: list[str], sources: _Sources) -> tuple[DictConfig, list[Problem]]:
    problems: list[Problem] = []
    good: list[str] = []
    scalars: dict[str, tuple[Any, str]] = {}  # key -> (value, override) of values that are not sections
    for item in overrides:
        key, value, problem = _parse_override(item)
        parents = [".".join(key.split(".")[:n]) for n in range(1, key.count(".") + 1)]
        clash = next((p for p in parents if p in scalars), None)
        if problem is None and clash is not None:
            # OmegaConf would silently replace the earlier value with a section.
            earlier, by = scalars[clash]
            problem = Problem(
                f"override {item!r}",
                f"{clash} was set to {earlier!r} by override {by!r}, which is not a section",
                "Drop one of the two overrides.",
            )
        if problem is not None:
            problems.append(problem)
            continue
        if not isinstance(value, dict):
            scalars[key] = (value, item)
        good.append(item)
        sources.where[key] = f"override {item!r}"
    return OmegaConf.from_dotlist(good), problems


def _check_resolvers(data: Any, sources: _Sources, prefix: str = "") -> list[Problem]:
    """``${name:...}`` calls other than ``oc.env``: a recipe is data, nothing in it is evaluated."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _check_resolvers(v, sources, f"{prefix}{k}.")]
    if isinstance(data, list):
        return [p for v in data for p in _check_resolvers(v, sources, prefix)]
    if not isinstance(data, str):
        return []
    names = sorted({n for n in _RESOLVER.findall(data) if n not in ALLOWED_RESOLVERS})
    fix = "A recipe may use ${section.key} references and ${oc.env:VARIABLE[,default]} only."
    return [Problem(sources.of(prefix.rstrip(".")), f"the resolver {n} is not allowed", fix) for n in names]


@functools.cache
def _schema_keys(schema: type = Recipe) -> dict[str, Any]:
    return {key: sub for key, _, sub in iter_fields(schema)}


def _check_keys(
    data: Any, sources: _Sources, schema: type = Recipe, prefix: str = "", cls: type | None = None
) -> list[Problem]:
    """Unknown keys of ``schema`` (a recipe class), with the closest valid key suggested."""
    problems: list[Problem] = []
    if not isinstance(data, dict):
        return problems
    names = {f.name: f for f in fields(cls or schema)}
    all_keys = list(_schema_keys(schema))
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            close = difflib.get_close_matches(key, all_keys, n=1, cutoff=0.6) or difflib.get_close_matches(
                str(k), list(names), n=1, cutoff=0.5
            )
            fix = (
                f"Did you mean {close[0] if '.' in close[0] or not prefix else prefix + close[0]}?"
                if close
                else (f"Valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(names)}.")
            )
            problems.append(Problem(sources.of(key), "unknown key", fix))
            continue
        if key in FREE_FORM:
            continue
        sub = _schema_keys(schema).get(key)
        if sub is not None and isinstance(v, dict):
            problems.extend(_check_keys(v, sources, schema, key + ".", sub))
        elif sub is not None and v is not None and not isinstance(v, dict):
            problems.append(Problem(sources.of(key), f"must be a mapping (a section), got {v!r}"))
    return problems


def _check_types(schema: type, base: DictConfig, data: dict, sources: _Sources, prefix: str = "") -> list[Problem]:
    """Merge leaf by leaf so every type error is reported, each with its key."""
    problems: list[Problem] = []
    keys = _schema_keys(schema)
    for k, v in data.items():
        key = f"{prefix}{k}"
        if key not in keys:
            continue  # reported by _check_keys
        sub = keys.get(key)
        if key not in FREE_FORM and sub is not None and isinstance(v, dict):
            problems.extend(_check_types(schema, base, v, sources, key + "."))
            continue
        try:
            OmegaConf.merge(base, OmegaConf.from_dotlist([]), _nest(key, v))
        except _MERGE_ERRORS as e:  # TypeError: a mapping into a list
            msg = _first_line(e)
            problems.append(
                Problem(sources.of(key), f"wrong type: {msg}", "Use a value of the type shown in docs/recipe.md.")
            )
    return problems


def _recipe_class(file_cfg: DictConfig, over_cfg: DictConfig, sources: _Sources) -> tuple[type[Recipe], list[Problem]]:
    """The recipe class with the sections of the module ``train.objective_module`` names, imported
    here from the layers as given: its sections must be known before keys and types are checked. A
    module that fails to import is reported here only when the recipe has sections the schema lacks
    (else ``llmft.plan.resolve`` reports it, with the objective it was to register)."""
    raws = [OmegaConf.to_container(layer, resolve=False) for layer in (file_cfg, over_cfg)]
    if any(_check_resolvers(raw, _Sources()) for raw in raws):
        return Recipe, []  # ${...} is evaluated only once no resolver but oc.env is in the recipe
    try:
        module = OmegaConf.select(OmegaConf.merge(file_cfg, over_cfg), MODULE_KEY, default=None)
    except _MERGE_ERRORS:  # the layers' shapes or an unset variable: reported below
        return Recipe, []
    if not isinstance(module, str) or not module:
        return Recipe, []
    try:
        import_module(module, MODULE_KEY)
    except UserError as e:
        if not {k for raw in raws for k in raw} - set(builtin_sections()):
            return Recipe, []
        return Recipe, [Problem(sources.of(p.where), p.what, p.fix) for p in e.problems]
    return recipe_class(module), []


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def load_recipe(
    path: str | os.PathLike | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
) -> Recipe:
    """Load, merge, resolve interpolations and check. Raises ``RecipeError`` listing every problem.

    The result is the user's intent, unchanged by any decision (``auto`` stays ``auto``);
    ``llmft.plan.resolve`` turns it into a ``RunPlan``. ``nnodes`` / ``nproc_per_node`` are the
    command line's layout options, applied like overrides.
    """
    recipe, problems = load_unchecked(path, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node)
    if problems:
        raise RecipeError(*problems, title=f"the recipe has {len(problems)} problem(s)")
    return recipe


def load_unchecked(
    path: str | os.PathLike | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
) -> tuple[Recipe, list[Problem]]:
    """The recipe and the problems of its values (keys and types must be right: those raise here),
    so that a caller can add the problems it finds itself and report them all at once."""
    file_sources, over_sources, sources = _Sources(), _Sources(), _Sources()
    file_cfg = _read_yaml(resolve_recipe_path(path), file_sources) if path is not None else OmegaConf.create({})
    over_cfg, problems = _parse_overrides(list(overrides), over_sources)
    sources.where = {**file_sources.where, **over_sources.where}

    recipe_cls, module_problems = _recipe_class(file_cfg, over_cfg, sources)
    problems.extend(module_problems)
    schema = OmegaConf.structured(recipe_cls)
    for layer, layer_sources in ((file_cfg, file_sources), (over_cfg, over_sources)):
        raw = OmegaConf.to_container(layer, resolve=False)
        problems.extend(_check_resolvers(raw, layer_sources))
        problems.extend(_check_keys(raw, layer_sources, recipe_cls))
        problems.extend(_check_types(recipe_cls, schema, raw, layer_sources))
    if problems:
        raise RecipeError(*problems, title=f"recipe {path} has {len(problems)} problem(s)" if path else "")

    try:
        cfg = OmegaConf.merge(schema, file_cfg, over_cfg)
    except _MERGE_ERRORS as e:  # each layer merged alone above
        raise RecipeError(Problem(str(path), f"the overrides do not merge into the recipe: {_first_line(e)}")) from None
    if nnodes is not None:
        cfg.distributed.nnodes = nnodes
        sources.where["distributed.nnodes"] = "--nnodes"
    if nproc_per_node is not None:
        cfg.distributed.nproc_per_node = nproc_per_node
        sources.where["distributed.nproc_per_node"] = "--nproc-per-node"
    env_refs = _env_references(OmegaConf.to_container(cfg, resolve=False))
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        raise RecipeError(
            Problem(
                sources.of(key) if key else str(path),
                f"interpolation failed: {_first_line(e)}",
                "Check the ${...} reference names an existing key.",
            )
        ) from None
    recipe: Recipe = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    recipe._provenance = sources  # type: ignore[attr-defined]  # not a recipe key: where each key was set
    recipe._env_refs = env_refs  # type: ignore[attr-defined]  # keys set from the environment, as written
    problems = check_values(recipe, sources.of)
    if problems:  # combinations of out-of-range values say nothing more
        raise RecipeError(*problems, title=f"the recipe has {len(problems)} problem(s)")
    return recipe, check_combinations(recipe, sources.of)


def _env_references(raw: Any, prefix: str = "") -> dict[str, str]:
    """Dotted key -> the value as written, for every value that reads the environment (``${oc.env:...}``).

    Those values are resolved for the run but written back as they were typed into every file llmft
    writes (compiled recipe, run and checkpoint recipe.yaml): a secret read from the environment
    never lands on a shared disk."""
    out: dict[str, str] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            out.update(_env_references(v, f"{prefix}{k}."))
    elif isinstance(raw, str) and "${oc.env:" in raw:
        out[prefix.rstrip(".")] = raw
    return out


def unresolve_env(recipe: Recipe) -> None:
    """Put the ``${oc.env:...}`` values of a (copied) recipe back as written; see ``_env_references``."""
    for key, raw in getattr(recipe, "_env_refs", {}).items():
        *parents, leaf = key.split(".")
        node: Any = recipe
        for part in parents:
            node = node[part] if isinstance(node, dict) else getattr(node, part)
        if isinstance(node, dict):
            node[leaf] = raw
        else:
            setattr(node, leaf, raw)


def provenance(recipe: Recipe) -> Callable[[str], str]:
    """``key -> "file:line: key"`` (or the override that set it) for messages about ``recipe``."""
    sources = getattr(recipe, "_provenance", None)
    return sources.of if sources is not None else (lambda key: key)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"dotted.key": value}`` (resume compatibility, tracker params)."""
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def to_container(recipe: Recipe) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)  # type: ignore[return-value]


def to_yaml(recipe: Recipe) -> str:
    """The recipe as YAML. Its values are resolved at load; only the ``${oc.env:...}`` values that
    ``unresolve_env`` put back stay interpolations (list-valued keys included)."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe), resolve=False)
