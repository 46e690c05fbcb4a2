"""The objective registry (llmft/plan/objectives.py): every record's code imports, the recipe's
choices are the registry's names, the plan carries the objective and the reference decision, what
is not built yet is refused at resolve with its alternatives, and the loop never names an objective."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from llmft.plan.engines import load
from llmft.plan.objectives import (
    DEFAULT_OBJECTIVE,
    OBJECTIVE_NAMES,
    OBJECTIVES,
    objective_names,
    objective_spec,
)
from llmft.plan.resolve import load_plan, plan_summary
from llmft.recipe.load import RecipeError
from llmft.recipe.schema import PreferenceConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[2]

RECIPE = textwrap.dedent(
    """\
    run: {output_dir: runs/objective-test}
    model:
      config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
               intermediate_size: 128, vocab_size: 320}
      dtype: fp32
    data: {train: data/never-opened.jsonl, max_seq_len: 64}
    batch: {global_batch_size: 8, micro_batch_size: 2}
    train: {max_steps: 10}
    """
)


def _plan(tmp_path, *overrides: str, world_size: int = 1):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return load_plan(path, list(overrides), world_size=world_size)


@pytest.mark.parametrize("spec", OBJECTIVES, ids=lambda s: s.name)
def test_every_built_record_names_importable_code(spec):
    for path in (spec.runtime, spec.problems, spec.summary, spec.card_words):
        if path is not None:
            assert callable(load(path)), path


def test_the_recipe_takes_the_registry_names_and_refuses_others(tmp_path):
    """train.objective is checked against the registry (a user module may add names), not a list in
    the schema: an unknown name is refused at resolve with the registered ones."""
    import dataclasses

    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == "objective")
    assert "choices" not in field.metadata and field.default == DEFAULT_OBJECTIVE
    for name in OBJECTIVE_NAMES:
        # online RL reads prompts: room for a completion and a reward are its own keys
        rl = ["rollout.max_new_tokens=16", "rewards=[{function: 'grpo_rewards:exact'}]"]
        extra = rl if objective_spec(name).group is not None else []
        assert _plan(tmp_path, f"train.objective={name}", *extra).objective == name
    (problem,) = _problems(tmp_path, "train.objective=kto")
    # The names registered in this process: the built-ins, and any a test module registered before.
    names = ", ".join(objective_names())
    assert names.startswith("sft, dpo, reward")
    assert problem.endswith(
        f"train.objective: 'kto' is not one of {names} | Use one of them, or name the module that "
        'registers it in train.objective_module (docs/design.md, "Adding an objective").'
    ), problem
    assert objective_spec("sft").counts == "tokens" and objective_spec("dpo").counts == "pairs"


def test_an_objective_module_that_does_not_import_is_refused(tmp_path):
    problems = _problems(tmp_path, "train.objective_module=no_such_module_here", "train.objective=kto")
    assert "train.objective_module: cannot import 'no_such_module_here': ModuleNotFoundError" in problems[0]
    assert (
        f"train.objective: 'kto' is not one of {', '.join(objective_names())} (train.objective_module=no_such_module_here"
        in (problems[1])
    )


def test_registering_an_objective_refuses_a_taken_name_and_is_idempotent():
    from llmft.errors import UserError
    from llmft.plan.objectives import ObjectiveSpec, register_objective

    dpo = objective_spec("dpo")
    assert register_objective(dpo) is dpo  # the same record again (a module imported twice): a no-op
    with pytest.raises(UserError) as e:
        register_objective(ObjectiveSpec(name="dpo", title="mine", runtime="my.mod:Mine", counts="tokens"))
    assert "registers objective 'dpo', which is registered already (llmft.objectives.preference:" in str(e.value)
    assert objective_spec("dpo") is dpo


# --- no objective name is compared outside its record ----------------------------------------------

REGISTRY = "llmft/plan/objectives.py"
# train.objective's default: the recipe layer imports no plan/, so the schema spells it.
ALLOWED = {
    ("llmft/recipe/schema.py", DEFAULT_OBJECTIVE),
    ("llmft/objectives/grpo.py", "reward"),  # the metric (a completion's reward), as TRL names it
    ("llmft/objectives/grpo.py", "grpo"),  # its own checkpoint state's header, in its own module
}


def _name_literals(path: Path, names: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """Strings equal to an objective name in ``path``'s code (docstrings and messages aside: only a
    whole string that IS a name, which is what a comparison, a membership or a default compares)."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(root)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
    ]


def test_no_objective_name_is_compared_outside_its_record():
    """Behaviour is read from the record (``ObjectiveSpec``): the data layer from its ``record``, the
    model card from its ``head``/``card``, eval and verify from ``counts``."""
    found = []
    for path in sorted((ROOT / "llmft").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == REGISTRY:
            continue
        found += [hit for hit in _name_literals(path, OBJECTIVE_NAMES) if (rel, hit.rsplit("'", 2)[1]) not in ALLOWED]
    assert not found, "decide by the objective's record (llmft.plan.objectives), not its name:\n" + "\n".join(found)


def test_the_name_check_catches_what_it_is_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""sft in a docstring is words."""\nif objective in ("dpo", "reward"):\n    x = "sft or dpo"\n')
    hits = _name_literals(probe, OBJECTIVE_NAMES, tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == ["'dpo'", "'reward'"]


@pytest.mark.parametrize(
    "overrides,reference",
    [
        ([], "none"),
        (["train.objective=dpo", "peft.method=lora"], "adapters_disabled"),
        (["train.objective=dpo", "peft.method=dora"], "adapters_disabled"),
        (["train.objective=dpo"], "frozen_copy"),
        (["train.objective=dpo", "preference.reference=org/ref-model"], "model"),
        (["train.objective=dpo", "preference.loss_type=simpo"], "none"),
        (["train.objective=dpo", "preference.loss_type=orpo", "peft.method=lora"], "none"),
    ],
)
def test_the_plan_says_where_the_reference_comes_from(tmp_path, overrides, reference):
    plan = _plan(tmp_path, *overrides)
    assert plan.reference == reference
    summary = plan_summary(plan)
    assert summary["objective"] == plan.objective
    assert summary.get("reference") == (reference if plan.objective == "dpo" else None)


def _problems(tmp_path, *overrides: str, world_size: int = 1) -> list[str]:
    with pytest.raises(RecipeError) as e:
        _plan(tmp_path, *overrides, world_size=world_size)
    return [f"{p.where}: {p.what} | {p.fix}" for p in e.value.problems]


def test_what_is_not_built_is_refused_with_what_works(tmp_path):
    assert _plan(tmp_path, "train.objective=reward").objective_spec.head == "score"  # built: objectives/reward.py
    (ls,) = _problems(tmp_path, "train.objective=dpo", "preference.loss_type=ipo", "preference.label_smoothing=0.1")
    assert "preference.label_smoothing: is 0.1, but only loss_type=sigmoid (conservative DPO) uses it" in ls


def test_every_reference_resolves_under_deepspeed(tmp_path):
    zero3 = ["train.objective=dpo", "distributed.engine=deepspeed", "distributed.zero_stage=3"]
    assert _plan(tmp_path, *zero3, "peft.method=lora", world_size=2).reference == "adapters_disabled"
    assert _plan(tmp_path, *zero3, world_size=2).reference == "frozen_copy"
    assert _plan(tmp_path, *zero3, "preference.loss_type=simpo", world_size=2).reference == "none"


def test_preference_config_defaults_are_the_contract():
    p = PreferenceConfig()
    assert (p.loss_type, p.beta, p.label_smoothing, p.reference, p.precompute_reference) == (
        "sigmoid",
        0.1,
        0.0,
        "auto",
        False,
    )


def test_the_loop_never_names_an_objective():
    names = "|".join(OBJECTIVE_NAMES)
    pattern = re.compile(rf"""["']({names})["']""")
    for path in ("llmft/training/loop.py", "llmft/training/run.py", "llmft/training/evaluate.py"):
        hits = [line for line in (ROOT / path).read_text().splitlines() if pattern.search(line.split("#")[0])]
        assert not hits, f"{path}: {hits}"


def test_verify_checks_preference_runs_by_their_count(tmp_path):
    """llmft verify takes dpo and reward recipes (tests/integration/test_verify.py runs them)."""
    from llmft.training.verify import load_for_verify

    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    for objective in ("dpo", "reward"):
        plan = load_for_verify(str(path), [f"train.objective={objective}"])
        assert plan.objective == objective and plan.objective_spec.counts == "pairs"


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ([], ("up to 512 (8 sequences x 64)", "data: 100 training sequences, 10 optimizer steps (0.80 epochs)")),
        (["data.packing=true"], ("step: 512 (8 sequences x 64)", "data: 100 training rows")),
        (["train.objective=dpo"], ("up to 1,024 (8 pairs x 2 sequences x 64)", "data: 100 training pairs")),
        (["train.objective=dpo", "data.packing=true"], ("up to 1,024 (8 pairs x", "data: 100 training pairs")),
    ],
)
def test_the_banner_counts_what_the_objective_reads(tmp_path, overrides, expected):
    """A pair objective's items are pairs (two sequences each): the banner says so, from the record."""
    from types import SimpleNamespace

    import torch

    from llmft.job.dist import DistEnv
    from llmft.training.report import banner

    plan = _plan(tmp_path, *overrides)
    engine = SimpleNamespace(unwrap=lambda: torch.nn.Linear(2, 2))
    data = SimpleNamespace(train=range(100), num_rows=100)
    text = banner(plan, DistEnv(), 10, engine, data)
    for part in expected:
        assert part in text


# --- an objective from outside llmft says what it reads, and the generic code asks it -------------------


def _documents_problems(recipe, where):
    """The outside objective's own check (its record's ``problems``)."""
    from llmft.errors import Problem

    if recipe.rl.beta > 1:
        return [Problem(where("rl.beta"), f"is {recipe.rl.beta}, more than documents allow", "Use 1 or less.")]
    return []


def _documents_summary(plan):
    return [f"documents: {plan.batch.global_batch_size} per step, rl.beta {plan.recipe.rl.beta}"]


def _documents_card(spec, recipe):
    return f"{spec.card}; beta {(recipe.get('rl') or {}).get('beta')}"


@pytest.fixture
def documents(monkeypatch):
    """An objective registered from outside the package (this module): a unit word of its own, a
    section it reads (``rl``), its own check, summary lines and card words. The registry is restored after."""
    import llmft.plan.objectives as registry

    monkeypatch.setattr(registry, "_BY_NAME", dict(registry._BY_NAME))
    return registry.register_objective(
        registry.ObjectiveSpec(
            name="documents",
            title="whole documents",
            runtime="llmft.objectives.sft:SFTObjective",
            counts="tokens",
            card="documents (whole-document loss)",
            unit="documents",
            data_words="whole {unit}",
            reads=("rl",),
            settings="the documents' settings",
            problems=f"{__name__}:_documents_problems",
            summary=f"{__name__}:_documents_summary",
            card_words=f"{__name__}:_documents_card",
        )
    )


def test_an_outside_objective_is_described_by_its_record_everywhere(tmp_path, documents, capsys):
    """The banner, ``llmft plan``, ``llmft compile``, the data check, ``llmft verify``'s wording and
    the model card print what the record names: none of them knows the objective."""
    from types import SimpleNamespace

    import torch

    from llmft.errors import UserError
    from llmft.export.modelcard import _objective
    from llmft.job.dist import DistEnv
    from llmft.plan.compile import compile_recipe
    from llmft.plan.report import plan_command
    from llmft.training.report import banner
    from llmft.training.run import check_enough_data
    from llmft.training.verify import _big_batch_grads, _items

    overrides = ["train.objective=documents", "rl.beta=0.5"]  # it reads rl.*: not refused
    plan = _plan(tmp_path, *overrides)
    mine = "documents: 8 per step, rl.beta 0.5"
    engine = SimpleNamespace(unwrap=lambda: torch.nn.Linear(2, 2))
    text = banner(plan, DistEnv(), 10, engine, SimpleNamespace(train=range(100), num_rows=100))
    assert text.splitlines()[:2] == ["batch: micro 2 x accumulation 4 x data-parallel 1 = global 8", mine]
    assert "data: 100 training documents, 10 optimizer steps (0.80 epochs)" in text
    packed = _plan(tmp_path, *overrides, "data.packing=true")
    assert "data: 100 training rows," in banner(
        packed, DistEnv(), 10, engine, SimpleNamespace(train=range(100), num_rows=100)
    )
    listing = plan_command(str(tmp_path / "recipe.yaml"), overrides).splitlines()
    assert listing[1:3] == ["micro 2 x accumulation 4 x data-parallel 1 = global 8, 64 tokens per sequence", mine]
    assert compile_recipe(plan, tmp_path / "out").splitlines()[:2] == [
        "batch: micro 2 x accumulation 4 x data-parallel 1 = global 8",
        mine,
    ]
    with pytest.raises(UserError) as e:
        check_enough_data(3, plan)
    assert (
        "batch.global_batch_size: is 8, but the data has only 3 whole documents: one optimizer step would take "
        "some of them twice. Use a global batch of at most 3 documents, or more data."
    ) in str(e.value)

    def out_of_memory(batch):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(UserError) as e:
        _big_batch_grads(torch.nn.Linear(2, 2), {}, out_of_memory, plan.batch, _items(plan))
    assert "--samples: the big batch of 8 documents does not fit in cpu memory" in str(e.value)
    recipe = {"train": {"objective": "documents"}, "rl": {"beta": 0.5}}
    assert _objective(recipe) == "documents (whole-document loss); beta 0.5"


def test_an_outside_objective_checks_the_recipe_and_reads_its_sections(tmp_path, documents):
    """Its own check runs at resolve; a section it does not read is refused with the generic wording;
    a section it reads is one it names to users of other objectives."""
    assert _problems(tmp_path, "train.objective=documents", "rl.beta=2", "preference.beta=0.5") == [
        "override 'rl.beta=2': rl.beta: is 2.0, more than documents allow | Use 1 or less.",
        "override 'preference.beta=0.5': preference.beta: is 0.5, but train.objective=documents does not read "
        "preference.* (the DPO family's settings) | Remove it (default 0.1), or set train.objective=dpo.",
    ]
    assert _problems(tmp_path, "rl.beta=0.5") == [
        "override 'rl.beta=0.5': rl.beta: is 0.5, but train.objective=sft does not read rl.* (online RL's "
        "settings) | Remove it (default 0.0), or set train.objective=grpo or documents."
    ]


def test_a_record_reads_only_what_the_recipe_has(documents):
    """What a record reads is the schema's (recipe/schema.py) or a registered section (recipe/sections.py):
    a record naming a section the recipe has not, or a key its section has not, is refused when it registers."""
    import dataclasses

    from llmft.errors import UserError
    from llmft.plan.objectives import register_objective

    with pytest.raises(UserError) as e:
        register_objective(dataclasses.replace(documents, name="corpus", reads=("corpus", "rl.beta", "rl.gamma")))
    assert (
        "train.objective_module: registers objective 'corpus' reading 'corpus', 'rl.gamma', which the recipe has "
        "not. Name sections of the recipe (run, model, peft, data, batch, optim, train, checkpoint, preference, "
        'rollout, rl, rewards, distributed, moe) or keys of one ("rl.beta"); a section of its own is registered first, '
        "with llmft.recipe.sections.register_section."
    ) in str(e.value)


def test_no_generic_module_calls_one_objectives_code():
    """The banner, the reports, verify, the card and the resolver ask the record: they import nothing
    of one objective's own modules (its plan side or its runtime)."""
    import ast

    own = ("llmft.plan.rl", "llmft.plan.preference", "llmft.objectives.")
    generic = [
        "llmft/training/run.py",
        "llmft/training/report.py",
        "llmft/training/verify.py",
        "llmft/export/modelcard.py",
        "llmft/plan/resolve.py",
        "llmft/plan/compile.py",
        "llmft/plan/report.py",
    ]
    found = []
    for path in generic:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(own):
                if node.module not in ("llmft.objectives", "llmft.objectives.sequences"):  # the Protocol, shared sums
                    found.append(f"{path}:{node.lineno}: from {node.module} import ...")
    assert not found, "ask the objective's record (llmft.plan.objectives) instead:\n" + "\n".join(found)
