"""Read a recipe: YAML file (or compiled dir) + ``key=value`` overrides -> a checked ``Recipe``.

Problems are collected, not raised one by one: a recipe with a typo, a wrong
type and a bad batch reports all three at once, each with where it came from
(``file:line`` or the override) and how to fix it.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmft.errors import Problem, UserError
from llmft.recipe.schema import Recipe, iter_fields
from llmft.recipe.validate import check_combinations, check_values

FREE_FORM = {"model.config"}  # values that are arbitrary mappings, not schema sections
RECIPE_FILE = "recipe.yaml"


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
        return key


def _line_map(text: str, filename: str, sources: _Sources) -> None:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                sources.where[key] = f"{filename}:{k.start_mark.line + 1}"
                walk(v, key + ".")

    walk(root, "")


def resolve_recipe_path(path: str | os.PathLike) -> Path:
    p = Path(path)
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


def _read_yaml(path: Path, sources: _Sources) -> DictConfig:
    text = path.read_text()
    try:
        cfg = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(
            Problem(
                where,
                f"YAML syntax error: {what}",
                "Fix the YAML at that line (indentation, a missing ':' or an unclosed quote).",
            )
        ) from None
    if not isinstance(cfg, DictConfig):
        raise RecipeError(Problem(str(path), "a recipe must be a YAML mapping of sections (run:, model:, data: ...)"))
    _line_map(text, str(path), sources)
    return cfg


def _parse_overrides(overrides: list[str], sources: _Sources) -> tuple[DictConfig, list[Problem]]:
    problems: list[Problem] = []
    good: list[str] = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            problems.append(
                Problem(f"override {item!r}", "is not KEY=VALUE", "Write overrides as dotted keys, e.g. optim.lr=1e-4.")
            )
            continue
        try:
            OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as e:
            problems.append(Problem(f"override {item!r}", f"cannot be parsed: {str(e).splitlines()[0]}"))
            continue
        good.append(item)
        sources.where[key.strip()] = f"override {item!r}"
    return OmegaConf.from_dotlist(good), problems


@functools.cache
def _schema_keys() -> dict[str, Any]:
    return {key: sub for key, _, sub in iter_fields()}


def _check_keys(data: Any, sources: _Sources, prefix: str = "", cls: type = Recipe) -> list[Problem]:
    """Unknown keys, with the closest valid key suggested."""
    problems: list[Problem] = []
    if not isinstance(data, dict):
        return problems
    names = {f.name: f for f in fields(cls)}
    all_keys = list(_schema_keys())
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
        sub = _schema_keys().get(key)
        if sub is not None and isinstance(v, dict):
            problems.extend(_check_keys(v, sources, key + ".", sub))
        elif sub is not None and v is not None and not isinstance(v, dict):
            problems.append(Problem(sources.of(key), f"must be a mapping (a section), got {v!r}"))
    return problems


def _check_types(base: DictConfig, data: dict, sources: _Sources, prefix: str = "") -> list[Problem]:
    """Merge leaf by leaf so every type error is reported, each with its key."""
    problems: list[Problem] = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        if key not in _schema_keys():
            continue  # reported by _check_keys
        sub = _schema_keys().get(key)
        if key not in FREE_FORM and sub is not None and isinstance(v, dict):
            problems.extend(_check_types(base, v, sources, key + "."))
            continue
        try:
            OmegaConf.merge(base, OmegaConf.from_dotlist([]), _nest(key, v))
        except OmegaConfBaseException as e:
            msg = str(e).splitlines()[0]
            problems.append(
                Problem(sources.of(key), f"wrong type: {msg}", "Use a value of the type shown in docs/recipe.md.")
            )
    return problems


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
    schema = OmegaConf.structured(Recipe)
    file_cfg = _read_yaml(resolve_recipe_path(path), file_sources) if path is not None else OmegaConf.create({})
    over_cfg, problems = _parse_overrides(list(overrides), over_sources)
    sources.where = {**file_sources.where, **over_sources.where}

    for layer, layer_sources in ((file_cfg, file_sources), (over_cfg, over_sources)):
        raw = OmegaConf.to_container(layer, resolve=False)
        problems.extend(_check_keys(raw, layer_sources))
        problems.extend(_check_types(schema, raw, layer_sources))
    if problems:
        raise RecipeError(*problems, title=f"recipe {path} has {len(problems)} problem(s)" if path else "")

    cfg = OmegaConf.merge(schema, file_cfg, over_cfg)
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
                f"interpolation failed: {str(e).splitlines()[0]}",
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
