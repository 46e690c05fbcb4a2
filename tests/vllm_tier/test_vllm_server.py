"""``rollout.vllm.mode: server`` with the real vLLM: ``llmft rollout-server`` in its own process,
``llmft train`` syncing its weights into it over HTTP.

- The served engine samples what the colocated one does (the same seeds per completion, the same
  weights after each sync): a server run lands on the colocated run's weights, LoRA and full, and
  with 2 training ranks on the one-process run's.
- A server that stops answering (SIGSTOP) ends the job within ``distributed.timeout_s``, every rank
  with the error naming the server and what was waited for; the last checkpoint is usable (a
  colocated run resumes from it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_runs import rewards_importable
from helpers import ROOT, free_port, max_rel_diff, metrics, torchrun, train_inproc, wait_for_step
from test_vllm_rollout import PEFT, _in_sync, _recipe, _weights

pytestmark = pytest.mark.vllm


@contextlib.contextmanager
def rollout_server(recipe: Path, *overrides: str, processes: int = 1):
    port = free_port()
    launch = [sys.executable, "-m", "llmft"]
    if processes > 1:  # a tensor-parallel engine: one process per device it spans
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                  "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "-m", "llmft"]  # fmt: skip
    proc = subprocess.Popen(
        [*launch, "rollout-server", str(recipe), *overrides, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 180
        for line in proc.stdout:
            if "llmft rollout-server: serving" in line:
                break
            assert time.time() < deadline, "the server did not start"
        else:
            raise AssertionError(f"the server exited: {proc.wait()}")
        yield f"http://127.0.0.1:{port}", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("peft", ["lora", "full"])
def test_the_served_engine_samples_what_the_colocated_one_does(tmp_path, peft):
    colocated = tmp_path / "colocated"
    assert train_inproc(_recipe(colocated), *PEFT[peft]) == 0
    served = tmp_path / "served"
    recipe = _recipe(served)
    with rollout_server(recipe, *PEFT[peft]) as (url, _):
        assert train_inproc(recipe, *PEFT[peft], "rollout.vllm.mode=server", f"rollout.vllm.url={url}") == 0
    _in_sync(metrics(served / "run"))
    assert max_rel_diff(_weights(served), _weights(colocated)) <= 1e-6


def test_two_ranks_share_one_server(tmp_path):
    over = [*PEFT["full"], "distributed.engine=fsdp", "batch.micro_batch_size=2"]
    served = tmp_path / "served"
    recipe = _recipe(served)
    with rollout_server(recipe, *PEFT["full"]) as (url, _):
        proc = torchrun(
            ["train", str(recipe), *over, "rollout.vllm.mode=server", f"rollout.vllm.url={url}"],
            env=rewards_importable(),
            timeout=600,
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _in_sync(metrics(served / "run"))
    colocated = tmp_path / "colocated"
    proc = torchrun(["train", str(_recipe(colocated)), *over], env=rewards_importable(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert max_rel_diff(_weights(served), _weights(colocated)) <= 1e-6


def test_a_tensor_parallel_server_runs_one_engine_across_its_processes(tmp_path):
    """torchrun --nproc_per_node 2 llmft rollout-server: rank 0 answers, both ranks run every update and
    generation; the weights streamed in reach both halves of the engine (every step in sync)."""
    served = tmp_path / "served"
    recipe, tp = _recipe(served), "rollout.vllm.tensor_parallel_size=2"
    with rollout_server(recipe, *PEFT["full"], tp, processes=2) as (url, _):
        assert train_inproc(recipe, *PEFT["full"], tp, "rollout.vllm.mode=server", f"rollout.vllm.url={url}") == 0
    _in_sync(metrics(served / "run"))
    assert not [p for p in Path("/dev/shm").glob("*-cpushm_*") if "-[0-1]-" in p.name]  # nothing left behind
    one = subprocess.run(
        [sys.executable, "-m", "llmft", "rollout-server", str(recipe), tp],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert one.returncode == 2, one.stderr[-2000:]
    assert (
        "rollout.vllm.tensor_parallel_size: is 2, but llmft rollout-server was started as 1 process(es): the engine "
        "runs one process per device it spans. Start it with torchrun --nproc_per_node 2 -m llmft rollout-server "
        "RECIPE ..."
    ) in one.stderr


def test_a_server_that_stops_answering_ends_the_job_within_the_timeout(tmp_path):
    run = tmp_path / "stopped"  # the model in this test's folder (``_recipe``: its parent)
    recipe = _recipe(run)
    over = [*PEFT["lora"], "train.max_steps=4", "checkpoint.every_steps=1", "distributed.timeout_s=15"]
    with rollout_server(recipe, *PEFT["lora"]) as (url, server):
        train = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmft",
                "train",
                str(recipe),
                *over,
                "rollout.vllm.mode=server",
                f"rollout.vllm.url={url}",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **rewards_importable(), "OMP_NUM_THREADS": "1"},
        )
        wait_for_step(run / "run", 1, train)
        server.send_signal(signal.SIGSTOP)
        _, err = train.communicate(timeout=120)  # ended by distributed.timeout_s=15, or TimeoutExpired
    assert train.returncode == 2, err[-3000:]
    assert f"rollout.vllm.url: the rollout server at {url} did not answer while" in err
    assert "waited up to distributed.timeout_s=15 s" in err and "Traceback" not in err
    done = max(r["step"] for r in metrics(run / "run"))
    assert done < 4 and (run / "run" / "checkpoints" / f"step-{done}").is_dir()
    assert train_inproc(recipe, *over) == 0  # colocated, from the last checkpoint
    assert max(r["step"] for r in metrics(run / "run")) == 4
