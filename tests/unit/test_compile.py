"""`llmft compile` and the configs it writes, checked by the parsers of the tools that read them.

DeepSpeed's own ``DeepSpeedConfig``, HF's ``HfTrainerDeepSpeedConfig`` and
accelerate's config loader and launcher are the judges: a config they accept
for the intended data-parallel size, with our batch numbers, is one the engines
will run with the batch the recipe says.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import COMPILE_RECIPE, write_text_recipe

from llmft.plan.compile import compile_recipe
from llmft.plan.deepspeed import FALLBACK_HIDDEN_SIZE, deepspeed_config, host_live_window, zero_optimization
from llmft.plan.fsdp import Mesh, MixedPrecision, accelerate_config, fsdp_plan
from llmft.plan.resolve import resolve
from llmft.plan.shape import ModelShape, model_shape
from llmft.recipe import RecipeError, load_recipe, to_container
from llmft.recipe.schema import QuantizationConfig

# ZeRO stage -> the offload choices that stage allows (validate.py refuses the rest).
OFFLOADS = {
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none")],
    2: [("none", "none"), ("cpu", "none")],
    3: [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")],
}
DS_CASES = [
    (stage, opt, par, dtype, dp)
    for stage, offloads in OFFLOADS.items()
    for opt, par in offloads
    for dtype in ("fp32", "bf16", "fp16")
    for dp in (1, 2, 8)
]


def case_id(case: tuple) -> str:
    stage, opt, par, dtype, dp = case
    return f"zero{stage}-opt_{opt}-param_{par}-{dtype}-dp{dp}"


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    return write_text_recipe(tmp_path_factory, "recipe", COMPILE_RECIPE)


@pytest.fixture(scope="module")
def base(recipe_path):
    """COMPILE_RECIPE loaded once: load_recipe costs ~0.3 s (OmegaConf), resolving a copy ~4 ms."""
    return load_recipe(recipe_path)


def variant(base, dp: int, **changes):
    """The plan of a copy of ``base`` changed by ``section__key=value`` arguments, for ``dp`` ranks."""
    recipe = copy.deepcopy(base)
    recipe.batch.gradient_accumulation_steps = "auto"  # re-solved for dp, as a fresh load would
    recipe.distributed.nnodes, recipe.distributed.nproc_per_node = 1, dp
    for key, value in changes.items():
        *parents, name = key.split("__")
        obj = recipe
        for part in parents:
            obj = getattr(obj, part)
        setattr(obj, name, value)
    return resolve(recipe)


def ds_recipe(base, stage: int, opt: str, par: str, dtype: str, dp: int, **changes):
    settings = {
        "distributed__engine": "deepspeed",
        "distributed__zero_stage": stage,
        "distributed__offload_optimizer": opt,
        "distributed__offload_params": par,
        "model__dtype": dtype,
    }
    return variant(base, dp, **{**settings, **changes})


def walk(value):
    """Every scalar in a nested dict/list."""
    if isinstance(value, dict):
        for v in value.values():
            yield from walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v)
    else:
        yield value


class FakeMpu:
    """The data-parallel size DeepSpeedConfig should assume, without a process group."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self):
        return None

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


@pytest.fixture
def ds_parse(monkeypatch):
    """``DeepSpeedConfig(config, mpu=FakeMpu(dp))``.

    DeepSpeedConfig asks ``deepspeed.comm.get_rank()`` before it looks at the mpu;
    without an initialised backend that raises, DeepSpeed catches it and silently
    assumes world size 1, so every dp > 1 config would be judged for dp 1. Patching
    get_rank makes the mpu's data-parallel size the one that is checked.
    """
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    return lambda config, dp: DeepSpeedConfig(json.loads(json.dumps(config)), mpu=FakeMpu(dp))


# --- DeepSpeed ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", DS_CASES, ids=case_id)
def test_deepspeed_accepts_every_ds_config(case, base, ds_parse):
    stage, opt, par, dtype, dp = case
    run = ds_recipe(base, *case)
    config = deepspeed_config(run)
    parsed = ds_parse(config, dp)

    plan = run.batch
    assert parsed.world_size == dp
    assert parsed.train_batch_size == plan.global_batch_size == 32
    assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch_size == 2
    assert parsed.gradient_accumulation_steps == plan.gradient_accumulation_steps == 32 // (2 * dp)
    assert parsed.zero_optimization_stage == stage
    assert (parsed.bfloat16_config.enabled, parsed.float16_config.enabled) == (dtype == "bf16", dtype == "fp16")
    if dtype == "fp16":
        assert parsed.float16_config.loss_scale == 0  # dynamic
    zero = parsed.zero_config
    assert (zero.offload_optimizer.device if zero.offload_optimizer else "none") == opt
    assert (zero.offload_param.device if zero.offload_param else "none") == par
    if "nvme" in (opt, par):
        assert zero.offload_optimizer.nvme_path.as_posix() == run.recipe.distributed.nvme_path
    assert parsed.zero_force_ds_cpu_optimizer is False
    assert parsed.zero_allow_untested_optimizer is True
    assert "auto" not in json.dumps(config)
    assert not {"optimizer", "scheduler", "elasticity"} & set(config)


def test_deepspeed_rejects_our_config_for_another_dp_size(base, ds_parse):
    """The check above is real: the same JSON under a different world size fails DeepSpeed's own assertion."""
    run = ds_recipe(base, 2, "none", "none", "bf16", 2)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        ds_parse(deepspeed_config(run), 4)


def test_runtime_config_follows_the_real_world_size(base, tmp_path, ds_parse):
    """Compiled for 2 ranks, run on 8: the live recipe is re-solved and its config agrees with 8."""
    compile_recipe(ds_recipe(base, 3, "cpu", "cpu", "bf16", 2), tmp_path)
    live = resolve(load_recipe(tmp_path), 8)
    parsed = ds_parse(deepspeed_config(live), 8)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        32,
        2,
        2,
    )


def test_bucket_sizes_follow_hidden_size(base):
    run = ds_recipe(base, 3, "none", "none", "bf16", 1)
    assert deepspeed_config(run)["zero_optimization"] == zero_optimization(run.recipe, model_shape(run.recipe.model))
    zero = zero_optimization(run.recipe, ModelShape.from_config({"hidden_size": 64}))
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 10 * 64
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False

    fallback = zero_optimization(run.recipe, None)
    assert fallback["reduce_bucket_size"] == FALLBACK_HIDDEN_SIZE**2
    assert all(isinstance(v, int) for v in walk(fallback))  # bools are ints too; no strings, no "auto"


def test_known_hub_model_sizes_buckets_without_download(base):
    run = ds_recipe(
        base, 2, "none", "none", "bf16", 1, model__config=None, model__name_or_path="meta-llama/Llama-3.1-70B"
    )
    assert deepspeed_config(run)["zero_optimization"]["reduce_bucket_size"] == 8192**2


def test_gradient_clipping_off_is_zero(base):
    run = ds_recipe(base, 1, "none", "none", "bf16", 1, optim__max_grad_norm=None)
    assert deepspeed_config(run)["gradient_clipping"] == 0.0
    run = ds_recipe(base, 1, "none", "none", "bf16", 1, optim__max_grad_norm=0.5)
    assert deepspeed_config(run)["gradient_clipping"] == 0.5


# --- HF Trainer's view of the same JSON ------------------------------------------------------


@pytest.fixture(scope="module")
def hf_check(tmp_path_factory):
    """Run HF's trainer_config_process + finalize on our config; return its mismatches.

    ``TrainingArguments.world_size`` comes from accelerate's PartialState, i.e. from an
    initialised process group, so one CPU process always reports 1; the property is
    patched to the data-parallel size the config is meant for. HfTrainerDeepSpeedConfig
    registers itself globally (is_deepspeed_zero3_enabled() would turn true for the rest
    of the session), so it is unregistered at once.
    """
    import transformers
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    @functools.cache
    def training_args(micro: int, accumulation: int, max_norm: float, lr: float, dtype: str):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path_factory.mktemp("hf")),
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=max_norm,
            learning_rate=lr,
            bf16=dtype == "bf16",
            fp16=dtype == "fp16",
            use_cpu=True,
            report_to="none",
        )

    def check(run, config: dict, dp: int) -> list[str]:
        recipe = run.recipe
        max_norm = recipe.optim.max_grad_norm
        b = run.batch
        args = training_args(
            b.micro_batch_size,
            b.gradient_accumulation_steps,
            max_norm if max_norm is not None else 0.0,
            recipe.optim.lr,
            recipe.model.dtype,
        )
        original = type(args).world_size
        type(args).world_size = property(lambda self: dp)
        try:
            hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
            hf.trainer_config_process(args)
            model = SimpleNamespace(config=SimpleNamespace(hidden_size=recipe.model.config["hidden_size"]))
            hf.trainer_config_finalize(args, model, num_training_steps=recipe.train.max_steps)
            return hf.mismatches
        finally:
            type(args).world_size = original
            unset_hf_deepspeed_config()

    return check


def test_hf_trainer_sees_no_mismatch(base, hf_check):
    cases = [c for c in DS_CASES if c[4] != 1 or c[0] in (0, 3)]  # every stage, offload, dtype; dp 2 and 8
    for case in cases:
        run = ds_recipe(base, *case)
        assert hf_check(run, deepspeed_config(run), case[4]) == [], case


def test_hf_trainer_catches_a_wrong_batch(base, hf_check):
    """The HF check is real: a config for dp 2 judged at dp 4 is a mismatch."""
    run = ds_recipe(base, 2, "none", "none", "bf16", 2)
    with pytest.raises(ValueError, match="train_batch_size"):
        hf_check(run, deepspeed_config(run), 4)


# --- FSDP2 and accelerate ----------------------------------------------------------------------

FSDP_CASES = [
    ({}, 2),
    ({"model__dtype": "bf16", "distributed__offload_params": "cpu", "model__gradient_checkpointing": True}, 8),
    ({"model__dtype": "fp16", "distributed__reshard_after_forward": False}, 8),
    ({"model__dtype": "bf16", "distributed__hsdp_replicate": 2}, 8),
]


def fsdp_recipe(base, dp: int, **changes):
    return variant(base, dp, distributed__engine="fsdp", **changes)


def test_fsdp_plan_follows_recipe(base):
    run = fsdp_recipe(base, 8, **FSDP_CASES[1][0], distributed__reduce_dtype="bf16")
    plan = fsdp_plan(run)
    assert plan.version == 2 and plan.shard == ("decoder_layers", "root")
    assert plan.mixed_precision == MixedPrecision(param_dtype="bf16", reduce_dtype="bf16")
    assert plan.cpu_offload is True and plan.activation_checkpointing is True
    assert plan.mesh == Mesh(replicate=1, shard=8)
    assert plan.batch == {
        "global_batch_size": 32,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "dp_size": 8,
    }
    hsdp = fsdp_plan(fsdp_recipe(base, 8, **FSDP_CASES[3][0]))
    assert hsdp.mesh == Mesh(replicate=2, shard=4)
    assert hsdp.to_dict()["mesh"] == {"replicate": 2, "shard": 4}


@pytest.mark.parametrize("changes, dp", FSDP_CASES)
def test_accelerate_loads_and_launches_our_config(changes, dp, base, tmp_path, monkeypatch):
    """accelerate's own loader reads accelerate.yaml, its launcher turns it into the FSDP2
    environment, and its FSDP plugin builds from that environment with our choices."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    run = fsdp_recipe(base, dp, **changes)
    compile_recipe(run, tmp_path)
    path = tmp_path / "accelerate.yaml"
    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    assert loaded.distributed_type.value == "FSDP"
    assert (loaded.num_processes, loaded.num_machines, loaded.machine_rank) == (dp, 1, 0)
    assert loaded.main_process_port == run.recipe.distributed.master_port and loaded.use_cpu is False
    assert loaded.mixed_precision == {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[run.recipe.model.dtype]

    parser = launch_command_parser()
    known = {action.dest for action in parser._actions}
    assert set(loaded.fsdp_config) <= known, "every fsdp_config key must be an `accelerate launch` option"
    assert set(loaded.parallelism_config) <= known
    args, _, _ = _validate_launch_command(parser.parse_args(["--config_file", str(path), "-m", "llmft", "train", "x"]))
    env = prepare_multi_gpu_env(args)
    assert env["FSDP_VERSION"] == "2" and env["ACCELERATE_USE_FSDP"] == "true"

    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    plan = fsdp_plan(run)
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is plan.reshard_after_forward
    assert plugin.activation_checkpointing is plan.activation_checkpointing
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") is plan.cpu_offload
    if plan.mesh.replicate > 1:
        assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2" and env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "4"


# --- compile ---------------------------------------------------------------------------------------


def test_compile_writes_the_engine_files(base, tmp_path):
    ds = tmp_path / "ds"
    summary = compile_recipe(ds_recipe(base, 3, "cpu", "none", "bf16", 2), ds)
    names = sorted(str(p.relative_to(ds)) for p in ds.rglob("*") if p.is_file())
    assert names == [
        "ds_config.json",
        "launch/deepspeed.sh",
        "launch/hostfile",
        "launch/slurm.sbatch",
        "launch/torchrun.sh",
        "plan.yaml",
        "recipe.yaml",
    ]
    assert yaml.safe_load((ds / "plan.yaml").read_text())["model_init"] == "whole"  # a tiny fresh model
    assert "micro 2 x accumulation 8 x data-parallel 2 = global 32" in summary
    assert "tokens per optimizer step: up to 2,048" in summary
    assert "ZeRO stage 3" in summary
    assert all(name in summary for name in names)

    # Recompiling the same directory for FSDP leaves no stale DeepSpeed files behind.
    summary = compile_recipe(fsdp_recipe(base, 2, data__packing=True), ds)
    names = sorted(str(p.relative_to(ds)) for p in ds.rglob("*") if p.is_file())
    assert names == [
        "accelerate.yaml",
        "fsdp.yaml",
        "launch/slurm.sbatch",
        "launch/torchrun.sh",
        "plan.yaml",
        "recipe.yaml",
    ]
    assert "tokens per optimizer step: 2,048" in summary and "ZeRO" not in summary
    assert yaml.safe_load((ds / "fsdp.yaml").read_text())["batch"]["dp_size"] == 2


def test_no_auto_anywhere_in_compiled_files(base, tmp_path):
    run = ds_recipe(base, 2, "cpu", "none", "fp16", 8, distributed__engine="auto")
    assert run.engine == "deepspeed"  # auto resolves before anything is written
    compile_recipe(run, tmp_path)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert "auto" not in (tmp_path / "ds_config.json").read_text()
    assert "auto" not in set(walk(ds))
    resolved = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert "auto" not in resolved["batch"].values() and resolved["distributed"]["engine"] == "deepspeed"


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_recipe_yaml_reloads_to_the_same_plan(engine, recipe_path, tmp_path):
    run = resolve(load_recipe(recipe_path, [f"distributed.engine={engine}"], nnodes=2, nproc_per_node=4))
    compile_recipe(run, tmp_path)
    again = resolve(load_recipe(tmp_path))
    assert again.batch == run.batch and again.engine == run.engine and again.world == run.world
    assert to_container(again.recipe) == to_container(run.resolved_recipe())
    if engine == "deepspeed":
        assert json.loads((tmp_path / "ds_config.json").read_text()) == deepspeed_config(again)
    if engine == "fsdp":
        assert accelerate_config(again, fsdp_plan(again)) == yaml.safe_load((tmp_path / "accelerate.yaml").read_text())


# --- refusals added at compile time --------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, dp, message",
    [
        (
            {"distributed__engine": "deepspeed", "distributed__zero_stage": 0, "distributed__offload_optimizer": "cpu"},
            2,
            "ZeRO stage 0 has no optimizer partitions",
        ),
        (
            {
                "distributed__engine": "deepspeed",
                "distributed__zero_stage": 2,
                "distributed__offload_optimizer": "nvme",
            },
            2,
            "nvme optimizer offload needs ZeRO stage 3",
        ),
        (
            {"distributed__engine": "ddp", "distributed__hsdp_replicate": 2},
            2,
            "HSDP replica groups are an FSDP2 setting",
        ),
        (
            {"distributed__engine": "fsdp", "model__quantization": QuantizationConfig(bits=8), "peft__method": "lora"},
            1,
            "8-bit weights cannot be sharded by fsdp",
        ),
    ],
)
def test_compile_time_refusals(changes, dp, message, base):
    with pytest.raises(RecipeError, match=message):
        variant(base, dp, **changes)


@pytest.mark.parametrize(
    "engine, stage, storage",
    [
        ("single", 0, "uint8"),
        ("ddp", 0, "uint8"),
        ("deepspeed", 2, "uint8"),
        ("fsdp", 0, "bf16"),
        ("deepspeed", 3, "bf16"),  # ZeRO-3 partitions the packed weights like FSDP2
    ],
)
def test_4bit_storage_follows_the_engine(base, engine, stage, storage):
    """QLoRA: where parameters are sharded (FSDP2, ZeRO-3) the packed 4-bit bytes are stored as the
    compute dtype; elsewhere uint8."""
    plan = variant(
        base,
        1 if engine == "single" else 2,
        distributed__engine=engine,
        distributed__zero_stage=stage,
        model__dtype="bf16",
        model__quantization=QuantizationConfig(bits=4),
        peft__method="lora",
    )
    assert plan.quant_storage == storage


@pytest.mark.parametrize("engine, stage, name", [("fsdp", 0, "FSDP2"), ("deepspeed", 3, "ZeRO-3")])
def test_4bit_storage_other_than_the_compute_dtype_is_refused_where_sharded(base, engine, stage, name):
    with pytest.raises(RecipeError, match=f"uint8 differs from model.dtype bf16: {name} shards 4-bit weights"):
        variant(
            base,
            2,
            distributed__engine=engine,
            distributed__zero_stage=stage,
            model__dtype="bf16",
            model__quantization=QuantizationConfig(bits=4, quant_storage="uint8"),
            peft__method="lora",
        )


def test_a_cpu_run_keeps_one_zero3_layer_gathered_not_the_model(base, ds_parse):
    """On a CPU the gathered weights are host RAM: a CPU run's ZeRO-3 live window and reuse
    distance are one decoder layer as ZeRO-3 stores it (a 4-bit base's packed elements), never the
    whole model, and it prefetches nothing; the written config (a GPU's) keeps HF's 1e9 and its
    prefetch bucket; DeepSpeed accepts both."""
    run = ds_recipe(base, 3, "none", "none", "fp32", 2, peft__method="lora")
    shape = model_shape(run.recipe.model)
    on_cpu = deepspeed_config(run, device_is_host=True)
    zero = on_cpu["zero_optimization"]
    layer = shape.layer_linear_params + 2 * shape.hidden_size
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == layer
    assert zero["stage3_max_reuse_distance"] < shape.num_params // 2  # a layer, not the model (1e9: all of it)
    assert {k: v for k, v in on_cpu.items() if k != "zero_optimization"} == {
        k: v for k, v in deepspeed_config(run).items() if k != "zero_optimization"
    }
    written = deepspeed_config(run)["zero_optimization"]
    assert written["stage3_max_live_parameters"] == written["stage3_max_reuse_distance"] == 10**9
    # and a CPU run prefetches nothing: on gloo a gather overlaps nothing, it only holds weights sooner
    assert zero["stage3_prefetch_bucket_size"] == 0 < written["stage3_prefetch_bucket_size"]
    cpu_only = ("stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size")
    assert {k: v for k, v in zero.items() if k not in cpu_only} == {
        k: v for k, v in written.items() if k not in cpu_only
    }
    ds_parse(on_cpu, 2)

    qlora = ds_recipe(
        base, 3, "none", "none", "fp32", 2, peft__method="lora", model__quantization=QuantizationConfig(bits=4)
    )
    packed = host_live_window(qlora.recipe, shape)  # two weights a byte, four bytes an fp32 element
    assert packed == -(-shape.layer_linear_params // 8) + 2 * shape.hidden_size
    assert deepspeed_config(qlora, device_is_host=True)["zero_optimization"]["stage3_max_live_parameters"] == packed
    small = ModelShape.from_config({"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 16})
    bucket = zero_optimization(qlora.recipe, small)["stage3_prefetch_bucket_size"]
    assert host_live_window(qlora.recipe, small) == bucket  # a packed layer below one prefetch bucket
    assert host_live_window(run.recipe, None) == int(0.9 * FALLBACK_HIDDEN_SIZE**2)  # shape unknown: one bucket
    stage2 = ds_recipe(base, 2, "none", "none", "fp32", 2)
    assert deepspeed_config(stage2, device_is_host=True) == deepspeed_config(stage2)
