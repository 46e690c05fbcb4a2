"""`llmft compile` as a command, in a fresh interpreter each (the compilers themselves are tested in
tests/unit/test_compile.py): the files it writes, a clean error, no torch loaded, options and overrides in any order."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import COMPILE_RECIPE, write_text_recipe

from llmft.recipe import load_recipe


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    return write_text_recipe(tmp_path_factory, "recipe", COMPILE_RECIPE)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmft", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_compile_cli_end_to_end(recipe_path, tmp_path):
    out = tmp_path / "d"
    proc = run_cli(
        "compile", str(recipe_path), "distributed.engine=deepspeed", "--nproc-per-node", "2", "--out", "d", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "micro 2 x accumulation 8 x data-parallel 2 = global 32" in proc.stdout
    for name in ("recipe.yaml", "ds_config.json", "launch/torchrun.sh", "launch/deepspeed.sh", "launch/hostfile"):
        assert (out / name).is_file(), name
    assert json.loads((out / "ds_config.json").read_text())["gradient_accumulation_steps"] == 8


def test_compile_cli_batch_error_is_one_clean_message(recipe_path, tmp_path):
    proc = run_cli("compile", str(recipe_path), "--nproc-per-node", "3", "--out", "d", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "not divisible" in proc.stderr and "global_batch_size" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_compile_imports_no_torch(recipe_path, tmp_path):
    """What makes `llmft compile` start fast on a laptop: none of the heavy packages is loaded,
    neither by the imports nor by the command."""
    code = textwrap.dedent(
        """\
        import json, sys
        HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "peft", "bitsandbytes", "datasets")
        import llmft.cli, llmft.plan.compile, llmft.recipe
        imported = [m for m in HEAVY if m in sys.modules]
        rc = llmft.cli.main(sys.argv[1:])
        heavy = [m for m in HEAVY if m in sys.modules]
        print(json.dumps({"rc": rc, "imported": imported, "heavy": heavy}))
        """
    )
    # compile.py imports every compiler up front, so one engine exercises all the imports.
    proc = subprocess.run(
        [sys.executable, "-c", code, "compile", str(recipe_path), "distributed.engine=deepspeed", "--out", "d"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"rc": 0, "imported": [], "heavy": []}
    assert (tmp_path / "d" / "ds_config.json").is_file()


def test_overrides_may_follow_options(tmp_path):
    import subprocess
    import sys

    from helpers import ROOT

    out = tmp_path / "c"
    cmd = [
        sys.executable,
        "-m",
        "llmft",
        "compile",
        "configs/tiny-cpu.yaml",
        "--nproc-per-node",
        "2",
        "--out",
        str(out),
        "batch.global_batch_size=16",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert load_recipe(out).batch.global_batch_size == 16
    bad = subprocess.run([*cmd[:5], "--bogus"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
