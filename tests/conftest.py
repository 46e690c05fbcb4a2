import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests never touch the network and never see a GPU-only code path by accident.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models on a 2-core machine: one thread per process is several times faster than
# oversubscribing (and every torchrun child inherits it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tokenized-data cache of this test session (llmft.data.cache), never the user's ~/.cache.
_DATA_CACHE = tempfile.mkdtemp(prefix="llmft-test-cache-")
os.environ.setdefault("LLMFT_CACHE", _DATA_CACHE)


def pytest_configure(config):
    import torch  # a core dependency: a broken install fails here, not as skips

    torch.set_num_threads(1)


def pytest_unconfigure(config):
    shutil.rmtree(_DATA_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def python():
    return sys.executable


@pytest.fixture
def llmft_log():
    """Records of the llmft logger (which does not propagate once `llmft train` set it up). Not for
    tests that run `llmft train` in-process: its set-up replaces the logger's handlers (use capsys)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("llmft")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory) -> Path:
    """A tiny LoRA run with an MLflow file store and a held-out eval (the model card's facts), trained
    once for the unit and the integration model-card tests."""
    from helpers import train_inproc, write_recipe

    tmp = tmp_path_factory.mktemp("lora")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    recipe = write_recipe(
        tmp,
        peft__method="lora",
        peft__r=4,
        run__name="tiny-lora",
        run__trackers=["mlflow"],
        run__mlflow_tracking_uri=f"file:{tmp / 'mlruns'}",
        data__eval_fraction=0.1,
        train__max_steps=3,
    )
    assert train_inproc(recipe) == 0
    return tmp / "run"


@pytest.fixture
def episode_rewards(tmp_path, monkeypatch):
    """The reward module of the multi-turn episode tests (tests/episode_runs.py), importable as
    ``episode_rewards`` during the test (a subprocess: put ``tmp_path`` on its PYTHONPATH)."""
    from episode_runs import REWARD_MODULE

    (tmp_path / "episode_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("episode_rewards", None)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """A tiny model fitted to call a tool (tests/agent_runs.py's ``tool_model``), made once per session."""
    from agent_runs import tool_model

    return tool_model(tmp_path_factory.mktemp("agent") / "tool-model")


@pytest.fixture
def agent_tools(tmp_path, monkeypatch):
    """The live-episode tests' tools and environments (tests/agent_runs.py), importable as ``agent_tools``
    during the test (a subprocess: put ``tmp_path`` on its PYTHONPATH)."""
    from agent_runs import write_tools

    write_tools(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("agent_tools", None)
