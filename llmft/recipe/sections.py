"""Recipe sections a module outside llmft adds: one record each, found by the module a recipe names.

The schema's own sections are the fields of ``Recipe`` (``recipe/schema.py``). A user's objective
may read a section of its own: its module (the one ``train.objective_module`` names) calls

    register_section("scaled", ScaledConfig, "Scaled SFT's loss (train.objective: scaled_sft).")

with a dataclass of ``doc()`` fields, like the schema's sections. A recipe that names the module
loads with the section (``recipe_class``): its keys are type-checked, its unknown keys refused with
``file:line`` and the closest key, its values checked like the schema's, ``recipe.scaled.scale``
read wherever the recipe is, and the section written into every ``recipe.yaml``. A recipe that does
not name the module has no such section: ``scaled:`` is an unknown key, as it is in a process that
never imported the module.

A section belongs to the module that registered it (or to the package above it: a section
registered in ``mypkg.sections`` is a recipe's that names ``mypkg``). Its name may be no section of
the schema and no other module's. docs/design.md, "Adding an objective".
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import MISSING, dataclass, fields, is_dataclass, make_dataclass

from llmft.errors import Problem, UserError
from llmft.recipe.schema import Recipe, doc

MODULE_KEY = "train.objective_module"  # the recipe key that names a user's module


@dataclass(frozen=True)
class Section:
    """A top-level recipe section registered from outside llmft."""

    name: str  # the recipe key: ``scaled`` in ``scaled.scale``
    schema: type  # a dataclass of ``doc()`` fields, each with a default
    doc: str  # what the section is, in docs/recipe.md's words
    module: str  # the module that registered it (a recipe names it in train.objective_module)


_SECTIONS: dict[str, Section] = {}


def builtin_sections() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Recipe))


def register_section(name: str, schema: type, text: str) -> type:
    """Add the section ``name`` (a dataclass ``schema`` of ``doc()`` fields; ``text`` says what it is)
    to the recipes that name the calling module in ``train.objective_module``. Registering it again
    from the same module (a module imported twice) replaces it; a name the schema or another module
    has is refused. Returns ``schema``."""
    module = sys._getframe(1).f_globals.get("__name__", "")
    known = _SECTIONS.get(name)
    problems = []
    if not name.isidentifier():
        problems.append(("is not an identifier", "Name the section like the schema's: letters, digits, _."))
    elif name in builtin_sections():
        problems.append(("is a section of llmft's recipe schema", "Give the section a name of its own."))
    elif known is not None and known.module != module:
        problems.append((f"is registered already by {known.module}", "Give the section a name of its own."))
    problems += _schema_problems(schema)
    if problems:
        raise UserError(
            *[Problem(MODULE_KEY, f"registers recipe section {name!r}, which {what}", fix) for what, fix in problems]
        )
    _SECTIONS[name] = Section(name, schema, text, module)
    return schema


def _schema_problems(schema: type) -> list[tuple[str, str]]:
    """A section's schema is a dataclass whose every field has a default and a doc (``doc()``)."""
    if not (isinstance(schema, type) and is_dataclass(schema)):
        return [(f"has the schema {schema!r}, not a dataclass", "Pass a @dataclass of doc() fields.")]
    bad = [
        f.name
        for f in fields(schema)
        if "doc" not in f.metadata or f.default is MISSING and f.default_factory is MISSING
    ]
    if bad:
        what = f"has fields without a default and a doc ({', '.join(bad)})"
        return [(what, "Declare each field with llmft.recipe.schema.doc(default, text), as the schema does.")]
    return []


def registered_sections() -> dict[str, Section]:
    """Every section registered in this process, whichever module registered it."""
    return dict(_SECTIONS)


def sections_of(module: str | None) -> tuple[Section, ...]:
    """The sections a recipe naming ``module`` in train.objective_module has (its own and its submodules')."""
    if not module:
        return ()
    return tuple(s for s in _SECTIONS.values() if s.module == module or s.module.startswith(module + "."))


def recipe_class(module: str | None) -> type[Recipe]:
    """``Recipe``, or a subclass with the sections ``module`` registered (``sections_of``)."""
    return _with_sections(sections_of(module))


@functools.cache
def _with_sections(sections: tuple[Section, ...]) -> type[Recipe]:
    if not sections:
        return Recipe
    added = [(s.name, s.schema, doc(s.schema(), s.doc)) for s in sections]
    cls = make_dataclass("Recipe", added, bases=(Recipe,), namespace={"__module__": __name__})
    cls.__doc__ = f"The recipe with the sections {', '.join(s.name for s in sections)} of train.objective_module."
    return cls


def import_module(name: str, where: str) -> None:
    """Import a user's module a recipe names (it registers its objective and its sections when imported).
    Importing it runs its code: it is the user's own, named explicitly, like a reward function's
    ``module:name``. A refusal of its registration is raised as it is; any other failure names ``where``."""
    try:
        importlib.import_module(name)
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            Problem(
                where,
                f"cannot import {name!r}: {type(e).__name__}: {e}",
                "Name a module importable from this environment (on PYTHONPATH, or installed) that calls "
                "llmft.plan.objectives.register_objective.",
            )
        ) from e
