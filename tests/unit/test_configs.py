"""Every recipe shipped in configs/ loads, compiles, and says how to launch it.

Each is compiled as written and for data-parallel sizes 1, 2, 8 and 16; where the
batch cannot be split over that many ranks the failure must be a clean
``RecipeError`` that explains the batch equation, never a traceback.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import yaml

from llmft.plan.compile import compile_recipe
from llmft.plan.resolve import resolve
from llmft.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DP_SIZES = (1, 2, 8, 16)
QUICKSTART_DP_SIZES = (1, 2)  # the CPU quickstarts are only meant for a laptop or two gloo ranks
QUICKSTARTS = (
    "quickstart.yaml",
    "quickstart-dpo.yaml",
    "quickstart-grpo.yaml",
    "quickstart-tools-sft.yaml",
    "quickstart-tools.yaml",
)
# configs/quickstart-grpo.yaml names reward functions reversal:exact and reversal:per_char, which its
# header runs with PYTHONPATH=examples/rewards (quickstart-tools.yaml: and examples/tools, its
# calculator); resolving imports them.
EXAMPLE_REWARDS = ROOT / "examples" / "rewards"
EXAMPLE_TOOLS = ROOT / "examples" / "tools"


@pytest.fixture(autouse=True)
def example_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_REWARDS))
    monkeypatch.syspath_prepend(str(EXAMPLE_TOOLS))


def dp_sizes(path: Path) -> tuple[int, ...]:
    return QUICKSTART_DP_SIZES if path.name in QUICKSTARTS else DP_SIZES


@functools.cache
def loaded(path: Path):
    """load_recipe costs ~0.3 s (OmegaConf); each config is loaded once and resolved per dp size."""
    return load_recipe(path)


def for_dp(path: Path, dp: int):
    """What ``llmft compile PATH --nnodes 1 --nproc-per-node DP x N`` validates: the file's own batch
    and engine choices (``auto`` where it leaves them out), solved for ``dp`` data-parallel ranks
    (sequence groups of the file's ``distributed.sequence_parallel`` N ranks)."""
    recipe = copy.deepcopy(loaded(path))
    recipe.distributed.nnodes = 1
    recipe.distributed.nproc_per_node = dp * recipe.distributed.sequence_parallel
    return resolve(recipe)


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {
        "tiny-cpu.yaml",
        *QUICKSTARTS,
        "llama3-8b-qlora-1gpu.yaml",
        "llama3-8b-lora-fsdp-8gpu.yaml",
        "llama3-8b-full-zero3-2x8gpu.yaml",
        "llama3-70b-qlora-fsdp-8gpu.yaml",
    } <= names


def check_artefacts(run, out: Path, summary: str) -> None:
    """The batch equation is the same in the summary, the written recipe and the engine config."""
    plan = run.batch
    assert plan.equation() in summary
    written = yaml.safe_load((out / "recipe.yaml").read_text())["batch"]
    assert (written["global_batch_size"], written["micro_batch_size"], written["gradient_accumulation_steps"]) == (
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
    )
    if run.engine == "deepspeed":
        ds = json.loads((out / "ds_config.json").read_text())
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
            plan.global_batch_size,
            plan.micro_batch_size,
            plan.gradient_accumulation_steps,
        )
    if run.engine == "fsdp":
        assert yaml.safe_load((out / "fsdp.yaml").read_text())["batch"]["dp_size"] == plan.dp_size
    for script in ("torchrun.sh", "slurm.sbatch"):
        assert (out / "launch" / script).is_file()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_as_written(path, tmp_path):
    """Loads and compiles for its own layout, and its header gives a launch command for itself."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert header, f"{path.name} needs a header comment with the launch command"
    assert any(f"configs/{path.name}" in line and "llmft " in line for line in header), header

    run = resolve(loaded(path))
    assert run.engine in ("single", "ddp", "fsdp", "deepspeed")
    check_artefacts(run, tmp_path, compile_recipe(run, tmp_path))


@pytest.mark.parametrize(
    "path, dp",
    [(p, dp) for p in CONFIGS for dp in dp_sizes(p)],
    ids=lambda v: v.stem if isinstance(v, Path) else f"dp{v}",
)
def test_config_for_dp_size(path, dp, tmp_path):
    raw = yaml.safe_load(path.read_text())["batch"]
    g, m = raw["global_batch_size"], raw["micro_batch_size"]
    if g % (m * dp):
        with pytest.raises(RecipeError) as err:
            for_dp(path, dp)
        assert all(p.where.startswith("batch") for p in err.value.problems), err.value.render()
        assert f"global_batch_size {g} is not divisible" in str(err.value)
        return  # the refusal is what this world size must give: a pass, not a skip

    run = for_dp(path, dp)
    assert run.batch.gradient_accumulation_steps == g // (m * dp)
    check_artefacts(run, tmp_path, compile_recipe(run, tmp_path))
