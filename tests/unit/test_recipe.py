import pytest
from helpers import TINY_RECIPE

from llmft.plan.resolve import load_plan
from llmft.recipe import RecipeError, load_recipe, to_yaml


@pytest.fixture
def recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(TINY_RECIPE)
    return p


def errors(path, overrides=(), **kw) -> str:
    """Every problem, the recipe's own and the plan's (engine, batch), as `llmft` reports them."""
    with pytest.raises(RecipeError) as e:
        load_plan(path, list(overrides), **kw)
    return str(e.value)


def test_loads_and_solves(recipe_file):
    plan = load_plan(recipe_file, nproc_per_node=2)
    b = plan.batch
    assert (b.global_batch_size, b.micro_batch_size, b.gradient_accumulation_steps) == (16, 2, 4)
    assert plan.recipe.optim.lr == 1e-4  # YAML 1.1 would read "1e-4" as a string
    assert plan.engine == "fsdp"  # auto, full fine-tune on 2 ranks
    # the recipe stays the user's intent; the resolved copy is what recipe.yaml files hold
    assert plan.recipe.distributed.engine == "auto" and plan.recipe.batch.gradient_accumulation_steps == "auto"
    text = to_yaml(plan.resolved_recipe())
    assert "${" not in text
    assert "auto" not in text.split("batch:")[1].split("optim:")[0]
    assert plan.resolved_recipe().distributed.engine == "fsdp"


def test_intent_and_plan_problems_reported_together(recipe_file):
    msg = errors(recipe_file, ["model.quantization.bits=4", "distributed.engine=single"], nproc_per_node=2)
    assert "2 problem(s)" in msg
    assert "quantized weights cannot be fully fine-tuned" in msg and "single cannot run on 2 processes" in msg


def test_overrides_and_interpolation(recipe_file):
    r = load_recipe(recipe_file, ["optim.lr=3e-4", "run.name=x", "run.output_dir=runs/${run.name}"])
    assert r.optim.lr == 3e-4 and r.run.output_dir == "runs/x"


def test_quantization_override_creates_section(recipe_file):
    r = load_recipe(recipe_file, ["model.quantization.bits=4", "peft.method=lora"])
    assert r.model.quantization.bits == 4 and r.model.quantization.double_quant is True


def test_typo_key_suggests(recipe_file):
    msg = errors(recipe_file, ["optim.lrr=1"])
    assert "override 'optim.lrr=1': optim.lrr: unknown key. Did you mean optim.lr?" in msg


def test_typo_in_file_names_line(recipe_file):
    recipe_file.write_text(TINY_RECIPE.replace("max_seq_len: 64", "max_seqlen: 64"))
    msg = errors(recipe_file)
    assert f"{recipe_file}:9: data.max_seqlen: unknown key. Did you mean data.max_seq_len?" in msg


def test_wrong_type(recipe_file):
    msg = errors(recipe_file, ["peft.r=long"])
    assert "peft.r: wrong type" in msg and "'long'" in msg
    # data.max_seq_len also takes auto, so its other strings are a range problem, not a type's
    msg = errors(recipe_file, ["data.max_seq_len=long"])
    assert "data.max_seq_len: 'long' must be a whole number >= 2, or auto" in msg


def test_out_of_range_and_choice_reported_together(recipe_file):
    msg = errors(recipe_file, ["peft.r=0", "model.dtype=fp8"])
    assert "2 problem(s)" in msg
    assert "peft.r: 0 must be >= 1" in msg
    assert "model.dtype: 'fp8' is not one of fp32, bf16, fp16" in msg


def test_inconsistent_batch(recipe_file):
    msg = errors(recipe_file, ["batch.gradient_accumulation_steps=3"], nproc_per_node=2)
    assert "micro 2 x accumulation 3 x data-parallel 2 = 12, but global_batch_size is 16" in msg
    assert "gradient_accumulation_steps=4" in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run:\n  output_dir: x\nmodel:\n  dtype: [fp32\n")
    msg = errors(p)
    assert f"{p}:" in msg and "YAML syntax error" in msg


def test_missing_recipe(tmp_path):
    msg = errors(tmp_path / "nope.yaml")
    assert "nope.yaml: recipe file not found" in msg


def test_single_engine_on_two_ranks(recipe_file):
    assert "single cannot run on 2 processes" in errors(recipe_file, ["distributed.engine=single"], nproc_per_node=2)


def test_quantized_full_finetune_refused(recipe_file):
    assert "quantized weights cannot be fully fine-tuned" in errors(recipe_file, ["model.quantization.bits=4"])


def test_compiled_plan_resolved_for_new_world(recipe_file, tmp_path):
    compiled = tmp_path / "compiled.yaml"
    compiled.write_text(to_yaml(load_plan(recipe_file, nproc_per_node=2).resolved_recipe()))
    # A fully concrete (compiled) plan launched on 4 ranks keeps global and micro.
    plan = load_plan(compiled, world_size=4)
    b = plan.batch
    assert (b.global_batch_size, b.micro_batch_size, b.gradient_accumulation_steps, b.dp_size) == (16, 2, 2, 4)
    assert plan.notes == (
        "distributed.nproc_per_node is 2 in the recipe, but the launcher started 4 processes per node: using 4",
        "world size 4 differs from the compiled 2: re-solved to " + b.equation(),
    )


def test_micro_batch_auto_picks_the_largest_that_fits(recipe_file):
    from llmft.plan.memory import estimate

    r = load_plan(recipe_file, ["batch.micro_batch_size=auto", "distributed.gpu_memory_gb=80"], nproc_per_node=2)
    assert r.batch.micro_batch_size == 8  # the whole per-rank batch fits a tiny model
    assert r.batch.micro_batch_size * r.batch.gradient_accumulation_steps * 2 == r.batch.global_batch_size == 16
    # A budget between the estimates for micro 2 and micro 4 picks 2, and the equation stays exact.
    base = load_plan(recipe_file, nproc_per_node=2)
    micro2, micro4 = (estimate(base.recipe, base.engine, 2, m, 8 // m).total for m in (2, 4))
    gb = (micro2 + micro4) / 2 / 2**30
    r = load_plan(recipe_file, ["batch.micro_batch_size=auto", f"distributed.gpu_memory_gb={gb}"], nproc_per_node=2)
    assert (r.batch.micro_batch_size, r.batch.gradient_accumulation_steps) == (2, 4)


def test_micro_batch_auto_without_memory_size_asks_for_it(recipe_file):
    msg = errors(recipe_file, ["batch.micro_batch_size=auto"])
    assert "only one of the three batch keys can be solved" in msg and "distributed.gpu_memory_gb" in msg


# User errors through the real command line: exit 2, one message, no traceback, nothing written.


def cli_error(capsys, *argv: str) -> str:
    from llmft.cli import main

    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith(f"llmft {argv[0]}: error: ")
    return err


def compile_error(capsys, recipe, tmp_path, *overrides: str) -> str:
    err = cli_error(capsys, "compile", str(recipe), *overrides, "--out", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    return err


def test_override_that_is_not_yaml(capsys, recipe_file, tmp_path):
    err = compile_error(capsys, recipe_file, tmp_path, "optim.lr=[")
    assert "override 'optim.lr=[': the value is not valid YAML" in err and "Quote the value" in err


def test_yaml_tags_construct_nothing(capsys, recipe_file, tmp_path):
    marker = tmp_path / "ran"
    tag = f"!!python/object/apply:os.system ['touch {marker}']"
    err = compile_error(capsys, recipe_file, tmp_path, f"run.name={tag}")
    assert "the value is not valid YAML" in err and "python/object/apply:os.system" in err
    recipe_file.write_text(TINY_RECIPE + f"checkpoint:\n  resume: {tag}\n")
    err = compile_error(capsys, recipe_file, tmp_path)
    assert f"{recipe_file}:18:" in err and "python/object/apply:os.system" in err
    assert not marker.exists()


def test_recipe_that_is_not_utf8(capsys, recipe_file, tmp_path):
    recipe_file.write_bytes(TINY_RECIPE.encode().replace(b"runs/t", b"runs/\xff\xfe"))
    err = compile_error(capsys, recipe_file, tmp_path)
    assert f"{recipe_file}:2: is not UTF-8 text (byte 0xff at column 20)" in err


def test_override_that_is_not_utf8(capsys, recipe_file, tmp_path):
    # A byte that is not UTF-8 on the command line reaches Python as a lone surrogate.
    err = compile_error(capsys, recipe_file, tmp_path, "run.name=x\udcff")
    assert "override 'run.name=x\\udcff': is not UTF-8 text" in err


def test_seed_that_numpy_cannot_take_is_refused_before_the_run_dir(capsys, recipe_file, tmp_path):
    run_dir = tmp_path / "run"
    err = cli_error(capsys, "train", str(recipe_file), f"run.output_dir={run_dir}", f"run.seed={2**32}")
    assert "run.seed: 4294967296 must be in [0, 2**32)" in err
    assert not run_dir.exists()


def test_output_dir_that_is_a_file(capsys, recipe_file, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    err = compile_error(capsys, recipe_file, tmp_path, f"run.output_dir={a_file}")
    assert f"run.output_dir: {str(a_file)!r} is a file, not a directory" in err
    err = compile_error(capsys, recipe_file, tmp_path, f"run.output_dir={a_file}/run")
    assert f"{str(a_file)!r} is a file, not a directory" in err
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize(
    "override, key, shown",
    [
        ("optim.lr=1e400", "optim.lr", "inf"),
        ("optim.lr=-.inf", "optim.lr", "-inf"),
        ("peft.alpha=.nan", "peft.alpha", "nan"),
        ("train.epochs=inf", "train.epochs", "inf"),
        ("distributed.gpu_memory_gb=inf", "distributed.gpu_memory_gb", "inf"),
        ("optim.betas=[1e400,0.9]", "optim.betas", "inf"),
        ("model.config.rope_theta=.inf", "model.config.rope_theta", "inf"),
        ("data.train=[{path: a.jsonl, weight: .nan}]", "data.train", "nan"),
    ],
)
def test_floats_must_be_finite(capsys, recipe_file, tmp_path, override, key, shown):
    err = compile_error(capsys, recipe_file, tmp_path, override)
    assert f"{key}: {shown} is not a finite number" in err
    assert "1 problem(s)" in err and "must be" not in err  # not also a range problem


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_seq_len=" + "9" * 30, "data.max_seq_len: 999999999999999999999999999999 is too large"),
        ("run.seed=1" + "0" * 5000, "run.seed: the number has more than 4300 digits"),
        ("distributed.master_port=65536", "distributed.master_port: 65536 must be in [1, 65535]"),
        ("distributed.timeout_minutes=" + "9" * 15, "must be in [1, 525600] (a year)"),
        ("distributed.timeout_s=" + "9" * 15, "must be in [1, 31536000] (a year)"),
    ],
)
def test_huge_integers(capsys, recipe_file, tmp_path, override, message):
    assert message in compile_error(capsys, recipe_file, tmp_path, override)


def test_dotted_key_into_a_value_set_by_an_earlier_override(capsys, recipe_file, tmp_path):
    err = compile_error(capsys, recipe_file, tmp_path, "model=3", "model.dtype=fp32")
    assert "override 'model.dtype=fp32': model was set to 3 by override 'model=3'" in err


@pytest.mark.parametrize("override", ["a b=1", "optim..lr=1", ".lr=1", "optim.=1", "=", "=1", " =2"])
def test_override_keys_must_be_dotted_names(capsys, recipe_file, tmp_path, override):
    assert f"override {override!r}: is not KEY=VALUE with a dotted key" in compile_error(
        capsys, recipe_file, tmp_path, override
    )


def test_unknown_section_from_an_override_names_the_override(capsys, recipe_file, tmp_path):
    err = compile_error(capsys, recipe_file, tmp_path, "foo.bar=1")
    assert "override 'foo.bar=1': foo: unknown key" in err


def test_only_the_environment_resolver_is_evaluated(capsys, recipe_file, tmp_path, monkeypatch):
    item = "run.name=${oc.decode:'[1]'}"
    err = compile_error(capsys, recipe_file, tmp_path, item)
    assert f"override {item!r}: run.name: the resolver oc.decode is not allowed" in err
    monkeypatch.setenv("LLMFT_TEST_NAME", "from-env")
    assert load_recipe(recipe_file, ["run.name=${oc.env:LLMFT_TEST_NAME}"]).run.name == "from-env"


def test_every_problem_is_one_paragraph(capsys, recipe_file, tmp_path):
    err = compile_error(capsys, recipe_file, tmp_path, "optim.lr=1e400", "run.seed=-1", "peft.r=0")
    assert "\n\n" not in err.strip() and "3 problem(s)" in err


def test_compile_out_that_is_a_file(capsys, recipe_file, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    err = cli_error(capsys, "compile", str(recipe_file), "--out", str(a_file))
    assert f"{a_file}: cannot be written (File exists)" in err and "Choose another --out directory" in err
    assert a_file.read_text() == "mine"


def test_recipe_path_too_long(capsys, tmp_path):
    err = cli_error(capsys, "compile", str(tmp_path / ("a" * 5000)))
    assert "recipe file not found" in err or "cannot be read (File name too long)" in err


def test_an_int_too_large_for_a_float_key(capsys, recipe_file, tmp_path):
    err = compile_error(capsys, recipe_file, tmp_path, "optim.lr=" + "9" * 4000)
    assert "optim.lr: wrong type: int too large to convert to float" in err


def test_override_key_with_unicode_whitespace(capsys, recipe_file, tmp_path):
    assert "unknown key" in compile_error(capsys, recipe_file, tmp_path, "\x85ð=[]")


def test_recipe_that_is_one_yaml_scalar(capsys, recipe_file, tmp_path):
    recipe_file.write_text("0\n")
    err = compile_error(capsys, recipe_file, tmp_path)
    assert f"{recipe_file}: a recipe must be a YAML mapping of sections" in err


def test_mapping_into_a_list_key(capsys, recipe_file, tmp_path):
    assert "run.trackers: wrong type" in compile_error(capsys, recipe_file, tmp_path, "run.trackers.x=1")


def test_model_config_without_a_hidden_size(capsys, recipe_file, tmp_path):
    recipe_file.write_text(TINY_RECIPE.replace("hidden_size: 64, ", ""))
    err = compile_error(capsys, recipe_file, tmp_path)
    assert "model.config: has no hidden_size (nor n_embd or d_model)" in err
