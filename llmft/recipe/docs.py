"""docs/recipe.md, rendered from the schema's field docs (the single source of what a key means).

    python -m llmft.recipe.docs > docs/recipe.md

A test fails when the committed file differs from what this renders. ``python -m llmft.recipe.docs
MODULE`` renders it with the sections a user's module registers (``llmft.recipe.sections``) after
the schema's.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import MISSING, Field, is_dataclass
from typing import Any

from llmft.errors import UserError
from llmft.limits import RECIPE_MAX_BYTES, RECIPE_MAX_DEPTH
from llmft.recipe.schema import Recipe, default_of, iter_fields
from llmft.recipe.sections import import_module, recipe_class

REGENERATE = "python -m llmft.recipe.docs > docs/recipe.md"

INTRO = f"""\
# Recipe reference

<!-- Generated from llmft/recipe/schema.py by `{REGENERATE}`. Do not edit by hand. -->

A recipe is one YAML file of the sections below. Every key is optional except what a run
needs (a model, `data.train`, and `train.max_steps` or `train.epochs`); unknown keys are an
error that suggests the closest valid key. Override any key on the command line with
OmegaConf dot-list syntax, e.g. `llmft train recipe.yaml optim.lr=1e-4 model.quantization.bits=4`.
Of the three batch keys, any one may be `auto`: it is solved from the other two and the
data-parallel size (see [batch.md](batch.md)). Complete, tested recipes live in `configs/`.
The module a recipe names in `train.objective_module` may add a section of its own
(`llmft.recipe.sections.register_section`, [design.md](design.md) "Adding an objective"): its
keys are checked like these, and `python -m llmft.recipe.docs MODULE` lists them after these.

A recipe is UTF-8 YAML and only data: a YAML tag (`!!python/...`) never constructs anything,
and of OmegaConf's interpolations only `${{section.key}}` references and `${{oc.env:VAR}}` (or
`${{oc.env:VAR,default}}`) are evaluated; any other resolver is an error. Every number must be
finite (no `.inf`, `.nan`, `1e400`) and every whole number fit 64 bits, in free-form values
such as `model.config` too. A recipe file may be at most {RECIPE_MAX_BYTES >> 20} MiB and nest
mappings and lists at most {RECIPE_MAX_DEPTH} levels deep (`model: config: x:` is 3; in an override
the key's parts count as levels); real recipes are a few KB and 2-6 levels, and a larger or deeper
one is refused before it is parsed (`llmft/limits.py`). Each error names the key, the file and
line or the override, and the fix; `llmft` exits 2 without a traceback.
"""


def render_recipe_docs(schema: type = Recipe) -> str:
    """The whole of docs/recipe.md: ``schema``'s sections (``recipe_class``: with a module's own)."""
    parts = [INTRO.rstrip()]
    owner: dict[str, type] = {"": schema}  # dotted prefix -> the dataclass holding its fields
    section: list[str] = []
    for key, f, sub in iter_fields(schema):
        parent = key.rpartition(".")[0]
        if sub is not None:
            owner[key] = sub
        if not parent:  # a top-level section
            if section:
                parts.append("\n".join(section))
            section = [
                f"## `{key}`",
                "",
                f.metadata["doc"],
                "",
                "| key | type | default | meaning |",
                "| --- | --- | --- | --- |",
            ]
            continue
        hint = typing.get_type_hints(owner[parent])[f.name]
        section.append(f"| `{key}` | {_type_name(hint, f)} | {_default(f)} | {_meaning(f)} |")
    parts.append("\n".join(section))
    return "\n\n".join(parts) + "\n"


def _type_name(hint: Any, f: Field) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0], f)} or null"
    if hint is Any:
        if any(isinstance(c, bool) for c in f.metadata.get("choices") or ()):
            return "bool or `auto`"
        return "int or `auto`" if default_of(f) == "auto" else "any (see meaning)"
    if is_dataclass(hint):
        return "section"
    origin = typing.get_origin(hint)
    if origin in (list, typing.List):
        return f"list of {_type_name(args[0], f)}" if args else "list"
    if origin in (dict, typing.Dict):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(f: Field) -> str:
    value = default_of(f)
    if value is MISSING:
        return "required"
    if is_dataclass(value):
        return "(section)"
    return f"`{_value(value)}`"


def _meaning(f: Field) -> str:
    text = f.metadata["doc"]
    choices = f.metadata.get("choices")
    if choices is not None:
        text += " One of: " + ", ".join(f"`{_value(c)}`" for c in choices) + "."
    return text.replace("|", "\\|")


if __name__ == "__main__":
    module = sys.argv[1] if len(sys.argv) > 1 else None
    if module:
        try:
            import_module(module, "python -m llmft.recipe.docs MODULE")
        except UserError as e:
            sys.exit(str(e))
    sys.stdout.write(render_recipe_docs(recipe_class(module)))
