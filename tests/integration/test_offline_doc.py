"""docs/offline.md's commands, as written: the blocks marked ``offline-test`` (train, export, evaluate the
export) run with HF_HUB_OFFLINE=1 on a tiny model directory and data written here, and the
``--no-index`` install finds llmft in a wheel directory built from this checkout by the page's own
``pip wheel`` line. The steps that need the network (downloading torch, DeepSpeed, models) are not
run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, TINY_LLAMA, metrics, save_tiny_pretrained, write_data

DOC = ROOT / "docs" / "offline.md"


def blocks(tag: str) -> list[str]:
    return re.findall(rf"```bash {tag}\n(.*?)```", DOC.read_text(), flags=re.S)


def bash_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = Path(sys.executable).parent  # `llmft` and `python` of this environment, first on PATH
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "HF_HOME": str(tmp_path / "empty-hf-home"),  # nothing cached: any download attempt would fail
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.slow
def test_offline_train_export_and_eval_commands_run(tmp_path):
    tagged = blocks("offline-test")
    assert len(tagged) == 2, "docs/offline.md: the train/export block and the evaluation block"
    save_tiny_pretrained(tmp_path / "models" / "my-model", seed=0)
    write_data(tmp_path / "data" / "train.jsonl", n=40)
    recipe = {  # the user's recipe: the doc's command line gives the model and data paths
        "model": {"dtype": "fp32", "attn_implementation": "eager"},
        "data": {"max_seq_len": 64, "num_workers": 0},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"name": "adamw", "lr": 1e-3},
        "train": {"max_steps": 2, "progress_bar": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    script = "set -euo pipefail\n" + "\n".join(tagged)
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attention eager; kernels: hub kernels off, liger off, compile off" in done.stderr
    assert len(metrics(tmp_path / "runs" / "offline")) == 2
    assert metrics(tmp_path / "runs" / "offline", "eval"), "the held-out eval ran"
    exported = tmp_path / "exported" / "my-model"
    assert json.loads((exported / "config.json").read_text())["hidden_size"] == TINY_LLAMA["hidden_size"]
    perplexity = float(re.search(r"^perplexity (\S+)$", done.stdout, flags=re.M).group(1))
    assert 1.0 < perplexity < TINY_LLAMA["vocab_size"]


def test_no_index_install_finds_llmft_in_the_wheel_directory(tmp_path):
    """The page's wheel line for llmft (without the extras and dependencies, which need the network),
    then its --no-index install line, resolved against that directory (a dry run: this environment
    already has llmft)."""
    wheel_line = next(line for line in bash_lines(DOC.read_text()) if line.startswith("pip wheel -w wheels --find"))
    install_line = next(line for line in bash_lines(DOC.read_text()) if "--no-index --find-links wheels" in line)
    source = tmp_path / "llmft-src"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "llmft", source / "llmft", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = wheel_line.replace('".[liger]"', str(source)) + " --no-deps --no-build-isolation"
    env = _env(tmp_path)
    done = subprocess.run(["bash", "-c", build], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == ["llmft-0.1.0-py3-none-any.whl"]
    install = install_line.replace('"llmft[liger]"', "llmft") + " --dry-run --ignore-installed --no-deps"
    done = subprocess.run(["bash", "-c", install], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Would install llmft-0.1.0" in done.stdout
