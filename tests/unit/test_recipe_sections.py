"""A recipe section added from outside llmft (llmft/recipe/sections.py): the module a recipe names
in ``train.objective_module`` registers it (tests/scaled_sft_objective.py: ``scaled.scale``), and
the recipe loads, checks, writes and reads it back like the schema's own sections; without the
module named it is an unknown key. Its objective's check, lines and card words read it through the
generic code (docs/design.md, "Adding an objective").

tests/integration/test_objective_section.py compiles, trains, verifies and exports it."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pytest

from llmft.errors import UserError
from llmft.recipe.load import RecipeError, load_recipe, to_container, to_yaml
from llmft.recipe.schema import doc

RECIPE = textwrap.dedent(
    """\
    run: {output_dir: runs/section-test}
    model:
      config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
               intermediate_size: 128, vocab_size: 320}
      dtype: fp32
    data: {train: data/never-opened.jsonl, max_seq_len: 64}
    batch: {global_batch_size: 8, micro_batch_size: 2}
    train: {max_steps: 10, objective: scaled_sft, objective_module: scaled_sft_objective}
    scaled:
      scale: 2.0
    """
)
BUILT_IN = "run, model, peft, data, batch, optim, train, checkpoint, preference, rollout, rl, rewards, distributed, moe"


def _recipe(tmp_path, text: str = RECIPE):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _problems(path, *overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as e:
        load_recipe(path, list(overrides))
    return [str(p) for p in e.value.problems]


def test_a_recipe_naming_the_module_has_its_section(tmp_path, monkeypatch):
    path = _recipe(tmp_path)
    recipe = load_recipe(path)
    assert recipe.scaled.scale == 2.0 and recipe.train.objective == "scaled_sft"
    assert load_recipe(path, ["scaled.scale=3"]).scaled.scale == 3.0
    # The module's name may be read from the environment, as any value (oc.env only).
    monkeypatch.setenv("SCALED_MODULE", "scaled_sft_objective")
    env = RECIPE.replace("objective_module: scaled_sft_objective", "objective_module: '${oc.env:SCALED_MODULE}'")
    assert load_recipe(_recipe(tmp_path, env)).scaled.scale == 2.0
    # Named by an override only, the module adds the section all the same.
    plain = RECIPE.replace(", objective: scaled_sft, objective_module: scaled_sft_objective", "")
    assert load_recipe(_recipe(tmp_path, plain), ["train.objective_module=scaled_sft_objective"]).scaled.scale == 2.0


def test_without_the_module_named_the_section_is_an_unknown_key(tmp_path):
    """In this process the module registered ``scaled`` (the test above): a recipe that does not name
    it still has no such section, with the schema's own message for any unknown key."""
    import scaled_sft_objective  # noqa: F401  # registered, whatever ran before

    plain = RECIPE.replace(", objective: scaled_sft, objective_module: scaled_sft_objective", "")
    path = _recipe(tmp_path, plain)
    assert _problems(path) == [f"{path}:9: scaled: unknown key. Valid keys under the top level: {BUILT_IN}."]
    assert _problems(path, "train.objective_module=null") == _problems(path)


def test_its_keys_are_checked_like_the_schemas(tmp_path):
    path = _recipe(tmp_path, RECIPE.replace("scale: 2.0", "scale: twice\n  scael: 2"))
    assert _problems(path) == [
        f"{path}:11: scaled.scael: unknown key. Did you mean scaled.scale?",
        f"{path}:10: scaled.scale: wrong type: Value 'twice' of type 'str' could not be converted to Float. "
        "Use a value of the type shown in docs/recipe.md.",
    ]
    assert _problems(_recipe(tmp_path), "scaled.scale=.inf") == [
        "override 'scaled.scale=.inf': scaled.scale: inf is not a finite number. Set scaled.scale to an ordinary number."
    ]
    assert (
        _problems(_recipe(tmp_path), "scaled=3")[0]
        == "override 'scaled=3': scaled: must be a mapping (a section), got 3"
    )


def test_a_module_that_fails_to_import_is_named_where_its_section_is_set(tmp_path):
    """Its section cannot be checked without it: the failed import is said first, with its file:line."""
    path = _recipe(tmp_path, RECIPE.replace("objective_module: scaled_sft_objective", "objective_module: no_such_mod"))
    assert _problems(path) == [
        f"{path}:8: train.objective_module: cannot import 'no_such_mod': ModuleNotFoundError: No module named "
        "'no_such_mod'. Name a module importable from this environment (on PYTHONPATH, or installed) that calls "
        "llmft.plan.objectives.register_objective.",
        f"{path}:9: scaled: unknown key. Valid keys under the top level: {BUILT_IN}.",
    ]


def test_the_written_recipe_holds_the_section_and_reads_back(tmp_path):
    """What every recipe.yaml holds (a compiled dir, a run, a checkpoint: ``to_yaml``) reloads with it."""
    recipe = load_recipe(_recipe(tmp_path), ["scaled.scale=0.5"])
    assert to_container(recipe)["scaled"] == {"scale": 0.5}
    text = to_yaml(recipe)
    assert text.endswith("scaled:\n  scale: 0.5\n")
    again = tmp_path / "again"
    again.mkdir()
    (again / "recipe.yaml").write_text(text)
    assert load_recipe(again).scaled.scale == 0.5  # a directory with a recipe.yaml, as compile writes


def test_a_section_name_is_refused_when_the_schema_or_another_module_has_it(monkeypatch):
    import scaled_sft_objective

    from llmft.recipe import sections

    monkeypatch.setattr(sections, "_SECTIONS", dict(sections._SECTIONS))

    @dataclass
    class Mine:
        x: int = doc(1, "A number.")

    def refusal(name: str, schema: type = Mine) -> str:
        with pytest.raises(UserError) as e:
            sections.register_section(name, schema, "mine")
        return str(e.value)

    assert refusal("model") == (
        "train.objective_module: registers recipe section 'model', which is a section of llmft's recipe schema. "
        "Give the section a name of its own."
    )
    assert refusal("scaled") == (
        "train.objective_module: registers recipe section 'scaled', which is registered already by "
        "scaled_sft_objective. Give the section a name of its own."
    )

    @dataclass
    class Undocumented:
        x: int = 1

    assert "which has fields without a default and a doc (x). Declare each field with " in refusal("mine", Undocumented)
    assert "which has the schema {'x': 1}, not a dataclass" in refusal("mine", {"x": 1})
    # The same module registering its section again (imported twice) replaces it.
    assert sections.register_section("mine", Mine, "mine") is Mine
    assert sections.register_section("mine", Mine, "mine, again") is Mine
    assert sections.sections_of(__name__) == (sections.Section("mine", Mine, "mine, again", __name__),)
    assert [s.name for s in sections.sections_of("scaled_sft_objective")] == ["scaled"]
    assert scaled_sft_objective.RECORD.reads == ("scaled",)


def test_an_objective_may_read_a_registered_section_only():
    import dataclasses

    import scaled_sft_objective

    from llmft.plan.objectives import register_objective

    with pytest.raises(UserError) as e:
        register_objective(dataclasses.replace(scaled_sft_objective.RECORD, name="scaled2", reads=("scaled.factor",)))
    assert "registers objective 'scaled2' reading 'scaled.factor', which the recipe has not" in str(e.value)
    assert "a section of its own is registered first, with llmft.recipe.sections.register_section." in str(e.value)


def test_another_objective_with_its_keys_set_is_refused_naming_the_one_that_reads_them(tmp_path):
    from llmft.plan.resolve import load_plan

    with pytest.raises(RecipeError) as e:
        load_plan(_recipe(tmp_path), ["train.objective=sft"])
    assert [str(p) for p in e.value.problems] == [
        f"{tmp_path / 'recipe.yaml'}:10: scaled.scale: is 2.0, but train.objective=sft does not read scaled.* "
        "(scaled SFT's settings). Remove it (default 1.0), or set train.objective=scaled_sft."
    ]
    assert load_plan(_recipe(tmp_path), ["train.objective=sft", "scaled.scale=1"]).objective == "sft"


def test_its_objective_checks_prints_and_describes_the_section(tmp_path, capsys):
    """Its check, its lines in ``llmft plan`` and ``llmft compile`` and its card words read the
    section through the record: the generic code names neither."""
    from llmft.cli import main
    from llmft.export.modelcard import _objective
    from llmft.plan.resolve import load_plan

    path = _recipe(tmp_path)
    with pytest.raises(RecipeError) as e:
        load_plan(path, ["scaled.scale=-1"])
    assert [str(p) for p in e.value.problems] == [
        "override 'scaled.scale=-1': scaled.scale: is -1.0, but the loss is scaled by a positive number. Use > 0."
    ]
    assert main(["plan", str(path)]) == 0
    assert "global 8, 64 tokens per sequence\nscaled SFT: loss x 2.0\n" in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["compile", str(path), "--out", str(out), "scaled.scale=4"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        "batch: micro 2 x accumulation 4 x data-parallel 1 = global 8",
        "scaled SFT: loss x 4.0",
    ]
    assert load_plan(out, []).recipe.scaled.scale == 4.0  # the compiled dir reads back with it
    card = _objective({"train": {"objective": "scaled_sft"}, "scaled": {"scale": 4.0}})
    assert card == "scaled_sft (next-token loss times a constant); scale 4.0"


def test_the_recipe_reference_lists_a_modules_section():
    from llmft.recipe.docs import render_recipe_docs
    from llmft.recipe.sections import recipe_class

    text = render_recipe_docs(recipe_class("scaled_sft_objective"))
    assert text.endswith(
        "## `scaled`\n\nScaled SFT's loss (train.objective: scaled_sft).\n\n| key | type | default | meaning |\n"
        "| --- | --- | --- | --- |\n| `scaled.scale` | float | `1.0` | Multiplies the SFT loss (train.objective: "
        "scaled_sft); > 0. |\n"
    )
    assert "## `scaled`" not in render_recipe_docs()  # docs/recipe.md: the schema's sections only
