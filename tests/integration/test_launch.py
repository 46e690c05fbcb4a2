"""Launch scripts: the repo's launch/ is what launch.py renders, every script parses, and run
against stub launchers (torchrun, deepspeed, srun, scontrol on PATH) each one execs the
right command on the right directory, also after the compiled directory was moved."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from llmft.plan import launch
from llmft.plan.compile import compile_recipe
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe
from llmft.stop import STOPPED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
REPO_LAUNCH = ROOT / "launch"

RECIPE = textwrap.dedent(
    """\
    run: {output_dir: runs/launch-test, name: my run}
    model:
      config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
               intermediate_size: 128, vocab_size: 320}
      dtype: bf16
    data: {train: data/never-opened.jsonl, max_seq_len: 64}
    batch: {global_batch_size: 32, micro_batch_size: 2}
    train: {max_steps: 10}
    distributed: {engine: deepspeed, zero_stage: 3, master_port: 29555, stop_signal: SIGUSR2}
    """
)

# Each stub logs its name, its arguments (one per line) and the rendezvous environment.
STUB = """\
#!/usr/bin/env bash
{{ echo "== $(basename "$0")"; printf '%s\\n' "$@"; echo "MASTER_ADDR=${{MASTER_ADDR:-}} MASTER_PORT=${{MASTER_PORT:-}}"; }} >> "$STUB_LOG"
{body}
"""
STUBS = {
    "torchrun": "",
    "deepspeed": "",
    "srun": 'exit "${SRUN_RC:-0}"',
    "scontrol": textwrap.dedent(
        """\
        case "$1 $2" in
          "show hostnames") printf 'gpu-a\\ngpu-b\\n' ;;
          "show job") echo "   JobId=$3 JobName=x"; echo "   Command=$SUBMITTED_SCRIPT arg"; echo "   WorkDir=/tmp" ;;
        esac"""
    ),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A DeepSpeed recipe compiled for 2 nodes x 4 GPUs."""
    root = tmp_path_factory.mktemp("compiled")
    (root / "recipe.yaml").write_text(RECIPE)
    compile_recipe(resolve(load_recipe(root / "recipe.yaml", nnodes=2, nproc_per_node=4)), root / "out")
    return root / "out"


@pytest.fixture
def stubs(tmp_path, monkeypatch) -> Path:
    """Stub launchers first on PATH; returns the log they append to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(STUB.format(body=body))
        path.chmod(0o755)
    log = tmp_path / "stub.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(log))
    for var in (
        "NNODES",
        "NPROC_PER_NODE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "HOSTFILE",
        "SLURM_JOB_ID",
        "PYTHON",
    ):
        monkeypatch.delenv(var, raising=False)
    return log


def run(script: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=30
    )


def calls(log: Path) -> list[list[str]]:
    """[[name, arg, arg, ..., env line], ...] from the stub log."""
    out: list[list[str]] = []
    for line in log.read_text().splitlines():
        if line.startswith("== "):
            out.append([line[3:]])
        else:
            out[-1].append(line)
    return out


def flag(call: list[str], name: str) -> str:
    return call[call.index(name) + 1]


# --- the generic launch/ directory --------------------------------------------------------------


def test_repo_launch_dir_is_what_launch_py_renders():
    rendered = launch.render(launch.GENERIC)
    on_disk = {p.name: p.read_text() for p in REPO_LAUNCH.iterdir() if p.is_file()}
    assert on_disk == rendered, "regenerate with: python -m llmft.plan.launch --write-generic launch/"
    assert launch.main(["--check", str(REPO_LAUNCH)]) == 0


def test_check_reports_a_stale_file(tmp_path, capsys):
    launch.main(["--write-generic", str(tmp_path)])
    (tmp_path / "torchrun.sh").write_text("#!/bin/bash\n")
    assert launch.main(["--check", str(tmp_path)]) == 1
    assert "torchrun.sh is out of date" in capsys.readouterr().out


def all_scripts(compiled: Path) -> list[Path]:
    return [REPO_LAUNCH / n for n in launch.SCRIPTS] + [compiled / "launch" / n for n in launch.SCRIPTS]


def test_every_script_parses_and_is_executable(compiled):
    for script in all_scripts(compiled):
        assert script.stat().st_mode & stat.S_IXUSR, script
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


def test_sbatch_directives_come_first_and_match_the_layout(compiled):
    text = (compiled / "launch" / "slurm.sbatch").read_text()
    lines = text.splitlines()
    directives = []
    for line in lines[1:]:  # sbatch stops reading #SBATCH at the first command
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            directives.append(line.removeprefix("#SBATCH "))
    assert directives == [
        "--job-name=my-run",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--signal=USR2@180",
        "--requeue",
        "--open-mode=append",
    ]
    commands = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert not any("torchrun" in line for line in commands), "srun must start llmft itself, not torchrun"
    assert "torchrun's agent" in text and "not forward SIGUSR2" in text  # the reason is written down
    generic = (REPO_LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=8" in generic and "#SBATCH --gpus-per-node=8" in generic


# --- behaviour against stub launchers --------------------------------------------------------------


def test_torchrun_defaults_and_multinode_overrides(compiled, stubs, tmp_path):
    moved = tmp_path / "elsewhere" / "compiled"
    shutil.copytree(compiled, moved)
    script = moved / "launch" / "torchrun.sh"
    assert run(script, "optim.lr=1e-4", cwd=tmp_path).returncode == 0
    assert run(script, cwd=tmp_path, NNODES="3", NODE_RANK="2", MASTER_ADDR="head", NPROC_PER_NODE="8").returncode == 0
    first, second = calls(stubs)
    assert first[0] == "torchrun"
    assert (flag(first, "--nnodes"), flag(first, "--nproc_per_node"), flag(first, "--node_rank")) == ("2", "4", "0")
    assert flag(first, "--rdzv_backend") == "c10d" and flag(first, "--rdzv_endpoint") == "127.0.0.1:29555"
    # The directory the script sits in, after the move, and the overrides passed through.
    assert first[first.index("-m") : -1] == ["-m", "llmft", "train", str(moved.resolve()), "optim.lr=1e-4"]
    assert (flag(second, "--nnodes"), flag(second, "--nproc_per_node"), flag(second, "--node_rank")) == ("3", "8", "2")
    assert flag(second, "--rdzv_endpoint") == "head:29555"


def test_deepspeed_uses_the_hostfile_only_on_several_nodes(compiled, stubs, tmp_path):
    script = compiled / "launch" / "deepspeed.sh"
    assert run(script, cwd=tmp_path).returncode == 0
    assert run(script, cwd=tmp_path, NNODES="1").returncode == 0
    multi, single = calls(stubs)
    assert flag(multi, "--hostfile") == str(compiled.resolve() / "launch" / "hostfile")
    assert (flag(multi, "--num_nodes"), flag(multi, "--num_gpus"), flag(multi, "--master_port")) == ("2", "4", "29555")
    assert multi[multi.index("--no_local_rank") : -1] == [
        "--no_local_rank",
        "--module",
        "llmft",
        "train",
        str(compiled.resolve()),
    ]
    assert "--hostfile" not in single and flag(single, "--num_nodes") == "1"


def test_hostfile_parses_with_deepspeeds_own_parser(compiled):
    from deepspeed.launcher import runner

    for path, expected in ((compiled / "launch" / "hostfile", {"node-0": 4, "node-1": 4}),):
        assert dict(runner._parse_hostfile(path.read_text().splitlines())) == expected
    generic = runner._parse_hostfile((REPO_LAUNCH / "hostfile").read_text().splitlines())
    assert dict(generic) == {"node-0": 8, "node-1": 8}


@pytest.mark.parametrize("srun_rc, requeued", [(0, False), (STOPPED_EXIT_CODE, True), (1, False)])
def test_slurm_runs_llmft_per_task_and_requeues_after_a_stop(srun_rc, requeued, compiled, stubs, tmp_path):
    # sbatch runs a spooled copy: the script must find the compiled dir from the job's Command.
    spool = tmp_path / "spool" / "job42"
    spool.mkdir(parents=True)
    shutil.copy(compiled / "launch" / "slurm.sbatch", spool / "slurm_script")
    proc = run(
        spool / "slurm_script",
        "train.max_steps=5",
        cwd=tmp_path,
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="gpu-[a-b]",
        SUBMITTED_SCRIPT=str(compiled / "launch" / "slurm.sbatch"),
        SRUN_RC=str(srun_rc),
    )
    assert proc.returncode == srun_rc, proc.stderr
    names = [c[0] for c in calls(stubs)]
    srun = next(c for c in calls(stubs) if c[0] == "srun")
    assert srun[1:-1] == [
        "--kill-on-bad-exit=0",
        "python",
        "-m",
        "llmft",
        "train",
        str(compiled.resolve()),
        "train.max_steps=5",
    ]
    assert srun[-1] == "MASTER_ADDR=gpu-a MASTER_PORT=29555"
    requeues = [c for c in calls(stubs) if c[0] == "scontrol" and c[1] == "requeue"]
    assert (requeues == [["scontrol", "requeue", "42", "MASTER_ADDR=gpu-a MASTER_PORT=29555"]]) is requeued, names


def test_generic_scripts_take_the_target_as_first_argument(stubs, tmp_path):
    assert (
        run(REPO_LAUNCH / "torchrun.sh", "configs/tiny-cpu.yaml", "a=1", cwd=tmp_path, NPROC_PER_NODE="2").returncode
        == 0
    )
    assert run(REPO_LAUNCH / "deepspeed.sh", "compiled/", cwd=tmp_path).returncode == 0
    torchrun, deepspeed = calls(stubs)
    assert torchrun[torchrun.index("-m") : -1] == ["-m", "llmft", "train", "configs/tiny-cpu.yaml", "a=1"]
    assert flag(torchrun, "--nproc_per_node") == "2" and flag(torchrun, "--nnodes") == "1"
    assert deepspeed[-2] == "compiled/" and "--hostfile" not in deepspeed

    missing = run(REPO_LAUNCH / "torchrun.sh", cwd=tmp_path)
    assert missing.returncode != 0 and "usage: launch/torchrun.sh RECIPE_OR_COMPILED_DIR" in missing.stderr


def test_compile_writes_launch_scripts_where_they_apply(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    recipe = load_recipe(tmp_path / "recipe.yaml", ["distributed.engine=fsdp"], nproc_per_node=2)
    compile_recipe(resolve(recipe), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "launch").iterdir()) == ["slurm.sbatch", "torchrun.sh"]


def test_the_rollout_server_script_parses_and_serves_on_the_first_node():
    script = REPO_LAUNCH / "rollout-server.sbatch"
    assert script.stat().st_mode & stat.S_IXUSR
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert '-m llmft rollout-server "$RECIPE" "$@"' in text and '--exclude="$SERVER"' in text
    assert '"rollout.vllm.url=http://$SERVER:$PORT"' in text
    assert '--gpus="$TP"' in text and '--nproc_per_node "$TP" -m llmft rollout-server' in text  # tensor parallel
