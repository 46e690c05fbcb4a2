"""A stop request is honoured within seconds in every phase (docs/checkpoints.md, "Stopping").

Each test runs the real command in a subprocess of its own session, makes one phase slow in a
natural way (a chat template that takes a fraction of a second a record, a reward function that
sleeps, generation of many tokens, an export of many tensors), waits until the phase is reached
(a file the phase writes appears, or a marker a reward function writes), sends SIGTERM to the
process group as a scheduler does, and asserts the exit code 75 within a bound far below the
time the phase would take, and what is on disk: the data build's finished shards kept, the
previous checkpoint intact, no partial export. Where the run continues, the resumed run's
weights equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_runs import REWARDS, TESTS, grpo_recipe
from helpers import checkpoint_weights, max_rel_diff, metrics, save_tiny_pretrained, write_jsonl, write_recipe

# Each render of this template spins through 10 million empty loop turns (about 0.4 s here)
# before writing the conversation: a build of 300 records takes minutes in one process.
SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
RECORDS = 300  # one shard (fewer than 4,096 records): tokenized in the building process itself
STOP_BOUND_S = 20.0  # from SIGTERM to the exit; the phase itself would take minutes


def _env(**extra: str) -> dict[str, str]:
    # The caller's PYTHONPATH first (it may name another checkout of llmft), then the tests' reward functions.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def _start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "llmft", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _env(), cwd=cwd,
        start_new_session=True,  # its own process group, which the test signals as a scheduler would
    )  # fmt: skip


def _wait_for(proc: subprocess.Popen, reached, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not reached():
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before {what}: {proc.communicate()[1][-4000:]}")
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, bound: float = STOP_BOUND_S) -> tuple[str, float]:
    """SIGTERM to the process group; (stderr, seconds to the exit). Fails if it runs past ``bound``."""
    os.killpg(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    try:
        _, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        err = proc.communicate()[1]
        raise AssertionError(f"still running {bound:.0f} s after SIGTERM: {err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return err, time.monotonic() - sent


def _sigterm_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "SIGTERM" in line]


# --- data build ------------------------------------------------------------------------------


def _chat_records(n: int, objective: str) -> list[dict]:
    out = []
    for i in range(n):
        user = {"role": "user", "content": f"reverse {'abcdefgh'[i % 8] * (i % 5 + 1)}"}
        answer = {"role": "assistant", "content": "ok"}
        if objective == "dpo":
            out.append({"prompt": [user], "chosen": [answer], "rejected": [{"role": "assistant", "content": "no"}]})
        elif objective == "grpo":
            out.append({"prompt": [user], "answer": "ok"})
        else:
            out.append({"messages": [user, answer]})
    return out


def _slow_build_recipe(root: Path, objective: str) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(root / "train.jsonl", _chat_records(RECORDS, objective))
    (root / "slow.jinja").write_text(SLOW_TEMPLATE)
    keys = {
        "data__train": str(data),
        "data__chat_template": str(root / "slow.jinja"),
        "data__cache_dir": str(root / "cache"),
        "data__num_proc": 1,
        "train__objective": objective,
    }
    if objective == "grpo":
        keys.update(rewards=REWARDS, rollout__num_generations=4, rollout__max_new_tokens=8)
        keys.update(batch__global_batch_size=8, batch__micro_batch_size=8)
    return write_recipe(root, **keys), root / "cache"


@pytest.mark.parametrize(
    "objective", ["sft", pytest.param("dpo", marks=pytest.mark.slow), pytest.param("grpo", marks=pytest.mark.slow)]
)
def test_sigterm_during_a_one_process_build_with_a_slow_chat_template_exits_75_within_seconds(tmp_path, objective):
    recipe, cache = _slow_build_recipe(tmp_path, objective)
    proc = _start(["prepare", str(recipe)], tmp_path)
    # The shard's file is opened right before its first record is rendered.
    _wait_for(proc, lambda: bool(list(cache.glob("*.build/shards/*.part"))), "the tokenizing")
    time.sleep(1.0)  # a few records in
    err, took = _stop(proc)
    assert proc.returncode == 75, err[-3000:]
    assert _sigterm_lines(err) == [
        "[llmft] SIGTERM received: stopping the data build; its finished shards are kept, "
        "and the same command continues from them"
    ], err[-3000:]
    assert "Traceback" not in err
    (work,) = cache.glob("*.build")
    assert sorted(p.name for p in work.iterdir()) == ["shards"]  # no half-written entry
    assert not list((work / "shards").iterdir())  # the one shard was unfinished: nothing half-written kept
    assert not [p for p in cache.iterdir() if p.is_dir() and not p.name.endswith(".build")]  # no entry


# --- online RL: scoring and generation -------------------------------------------------------

# Reward functions of the tests below (a module written beside each run): the first
# STOP_TEST_FAST_CALLS calls of a process answer at once, later ones write STOP_TEST_MARKER and
# take 3 s each (8 completions a step: a step scored slowly takes 24 s).
SLOW_REWARDS = """
import os, time
from pathlib import Path

calls = 0


def slow(prompt, completion, answer, **_):
    global calls
    calls += 1
    if calls > int(os.environ.get("STOP_TEST_FAST_CALLS", "1000000")):
        Path(os.environ["STOP_TEST_MARKER"]).write_text(str(calls))
        if os.environ.get("RANK") == "1":  # under torchrun: which process is rank 1's
            Path(os.environ["STOP_TEST_MARKER"] + "-rank1").write_text(str(os.getpid()))
        time.sleep(3)
    got = completion.strip()
    return sum(a == b for a, b in zip(got, answer)) / max(len(answer), 1)
"""


def _grpo(root: Path, **sections) -> Path:
    (root.parent / "slow_rewards.py").write_text(SLOW_REWARDS)
    keys = {
        "rewards": [{"function": "slow_rewards:slow"}],
        # in the training process, one call at a time (the stop between calls; a reward in workers is
        # dropped mid-call: tests/unit/test_reward_pool.py), and free to write the test's marker files
        "rl__reward_workers": 0,
        "train__max_steps": 2,
        "checkpoint__every_steps": None,  # the step-1 checkpoint of a stopped run is the one the stop writes
        **sections,
    }
    return grpo_recipe(root, **keys)


def _grpo_env(root: Path, **extra: str) -> dict[str, str]:
    env = _env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(root.parent)])
    return env


def _train(recipe: Path, root: Path, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "train", str(recipe)],
        capture_output=True, text=True, env=_grpo_env(root, **env), cwd=root, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step-*"))


def _final_weights(run: Path) -> dict:
    latest = (run / "checkpoints" / "latest").read_text().strip()  # a file naming the newest step dir
    return checkpoint_weights(run / "checkpoints" / latest)


def _abandoned_then_resumed(root: Path, recipe: Path, what: str, err: str, took: float) -> None:
    """The stopped run's disk and log, then the rerun of the same command to the end."""
    assert "Traceback" not in err, err[-3000:]
    sigterm = _sigterm_lines(err)
    assert sigterm[0] == (
        "[llmft] SIGTERM received: cutting this step's generation and scoring short: the step is abandoned "
        "(none of it is applied), the state before it is checkpointed, and the run exits"
    ), err[-3000:]
    assert (
        f"[llmft] step 2 abandoned: its {what} was cut short by SIGTERM; none of it is applied, and the same "
        "command resumes from step 1's checkpoint and does step 2 again with the same seeds"
    ) in err, err[-3000:]
    assert "stopped by SIGTERM after step 1; checkpoint written" in err
    run = root / "run"
    assert _checkpoints(run) == ["step-1"]  # written by the stop: checkpoint.every_steps is null
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-1"
    assert [r["step"] for r in metrics(run)] == [1]  # the abandoned step logged nothing
    resumed = _train(recipe, root)
    assert "resuming from" in resumed.stderr and "(step 1," in resumed.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2]


@pytest.mark.slow
def test_sigterm_while_rewards_are_scored_abandons_the_step_and_the_resume_equals_the_whole_run(tmp_path):
    whole = tmp_path / "whole"
    _train(_grpo(whole), whole)
    root = tmp_path / "stopped"
    recipe, marker = _grpo(root), tmp_path / "scoring"
    proc = _start(["train", str(recipe)], root, _grpo_env(root, STOP_TEST_FAST_CALLS="8", STOP_TEST_MARKER=str(marker)))
    _wait_for(proc, marker.exists, "step 2's scoring")  # step 1's 8 calls were fast
    err, took = _stop(proc, bound=15)  # the step's other 7 calls alone would take 21 s
    assert proc.returncode == 75, err[-3000:]
    assert marker.read_text() == "9"  # no call after the one running when the signal came
    _abandoned_then_resumed(root, recipe, "scoring", err, took)
    assert max_rel_diff(_final_weights(root / "run"), _final_weights(whole / "run")) == 0.0


@pytest.mark.slow
def test_sigterm_while_the_first_step_is_scored_writes_nothing_and_the_rerun_starts_over(tmp_path):
    recipe, marker = _grpo(tmp_path), tmp_path / "scoring"
    proc = _start(
        ["train", str(recipe)], tmp_path, _grpo_env(tmp_path, STOP_TEST_FAST_CALLS="0", STOP_TEST_MARKER=str(marker))
    )
    _wait_for(proc, marker.exists, "step 1's scoring")
    err, took = _stop(proc, bound=15)
    assert proc.returncode == 75, err[-3000:]
    assert (
        "[llmft] step 1 abandoned: its scoring was cut short by SIGTERM; none of it is applied, and the same "
        "command resumes from the start (nothing was trained yet) and does step 1 again with the same seeds"
    ) in err, err[-3000:]
    assert "[llmft] stopped by SIGTERM after step 0; nothing was trained yet. Run the same command to resume." in err
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() or _checkpoints(run) == []
    again = _train(recipe, tmp_path)
    assert "resuming from" not in again.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2] and _checkpoints(run) == ["step-2"]


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_one_of_two_ranks_while_scoring_abandons_the_step_on_both(tmp_path):
    """Only rank 1 gets the signal (a stop that reached one rank): rank 0 finishes its own calls, the
    vote after scoring abandons the step on both ranks, none waits for the other; the resumed
    2-rank run equals the 2-rank run that never stopped."""
    from helpers import torchrun, torchrun_cmd

    ddp = ["distributed.engine=ddp", "batch.micro_batch_size=2"]
    whole = tmp_path / "whole"
    done = torchrun(["train", str(_grpo(whole)), *ddp], env=_grpo_env(whole), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    root = tmp_path / "stopped"
    recipe, marker = _grpo(root), tmp_path / "scoring"
    env = _grpo_env(root, STOP_TEST_FAST_CALLS="4", STOP_TEST_MARKER=str(marker))  # 4 completions a rank a step
    proc = subprocess.Popen(
        [*torchrun_cmd(2), "-m", "llmft", "train", str(recipe), *ddp],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root, start_new_session=True,
    )  # fmt: skip
    rank1 = marker.with_name("scoring-rank1")
    _wait_for(proc, rank1.exists, "rank 1 scoring step 2")
    os.kill(int(rank1.read_text()), signal.SIGTERM)  # that rank's process alone
    try:
        _, err = proc.communicate(timeout=60)  # rank 0's own 4 calls take 12 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "exitcode  : 75" in err, err[-4000:]  # torchrun reports the ranks' 75
    assert (
        "[llmft rank 1] SIGTERM received: cutting this step's generation and scoring short: the step is abandoned"
        in err
    ), err[-4000:]
    assert "[llmft rank 0] step 2 abandoned: its scoring was cut short by a signal on another rank" in err
    assert "[llmft rank 1] step 2 abandoned: its scoring was cut short by SIGTERM" in err
    run = root / "run"
    assert _checkpoints(run) == ["step-1"] and [r["step"] for r in metrics(run)] == [1]
    again = torchrun(["train", str(recipe), *ddp], env=_grpo_env(root), timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert max_rel_diff(_final_weights(run), _final_weights(whole / "run")) == 0.0


def _long_generation(root: Path) -> Path:
    model = root.parent / "long-model"
    if not model.exists():
        save_tiny_pretrained(model, seed=1, max_position_embeddings=4096)
    return _grpo(
        root,
        model__name_or_path=str(model),
        rollout__backend="hf",
        rollout__file=None,
        rollout__max_new_tokens=GENERATE_TOKENS,
        rollout__temperature=0.5,
        data__max_seq_len=GENERATE_TOKENS + 64,
        rewards=REWARDS,
    )


GENERATE_TOKENS = 1500  # about 10 s of generation a step here (8 completions, eager attention, one thread)


@pytest.mark.slow
def test_sigterm_during_generation_abandons_the_step_within_seconds_and_the_resume_equals_the_whole_run(tmp_path):
    whole = tmp_path / "whole"
    done = _train(_long_generation(whole), whole)
    generation_s = [r["generation_s"] for r in metrics(whole / "run")]
    assert max(generation_s) > 5, generation_s  # the phase the stop cuts short is long (a step may end early at eos)
    root = tmp_path / "stopped"
    recipe = _long_generation(root)
    proc = _start(["train", str(recipe)], root, _grpo_env(root))
    # Step 1 is logged, then step 2 generates (no checkpoint in between: every_steps is null).
    _wait_for(proc, lambda: (root / "run" / "metrics.jsonl").exists() and bool(metrics(root / "run")), "step 1")
    time.sleep(1.0)
    err, took = _stop(proc, bound=max(generation_s))  # the stop waits for a token, not for the step
    assert proc.returncode == 75, err[-3000:]
    _abandoned_then_resumed(root, recipe, "generation", err, took)
    assert max_rel_diff(_final_weights(root / "run"), _final_weights(whole / "run")) == 0.0
    assert done.returncode == 0


# --- eval ----------------------------------------------------------------------------------


def test_sigterm_during_eval_generation_cuts_the_eval_short_and_checkpoints_the_finished_step(tmp_path):
    from helpers import TINY_LLAMA

    recipe = write_recipe(
        tmp_path,
        model__config={**TINY_LLAMA, "max_position_embeddings": 4096},
        data__eval_fraction=0.25,
        train__max_steps=4,
        train__eval_every_steps=1,
        train__eval_generate_samples=16,
        train__eval_max_new_tokens=3000,  # greedy completions of 3,000 tokens: minutes for 16 prompts
    )
    proc = _start(["train", str(recipe)], tmp_path)
    run = tmp_path / "run"
    # Step 1's row is written, then its eval runs (its checkpoint comes after the eval).
    _wait_for(proc, lambda: (run / "metrics.jsonl").exists() and bool(metrics(run)), "step 1's eval")
    time.sleep(1.0)
    err, took = _stop(proc)
    assert proc.returncode == 75, err[-3000:]
    assert _sigterm_lines(err) == [
        "[llmft] SIGTERM received: cutting the eval short: the last finished step is checkpointed, and the run exits",
        "[llmft] stopped by SIGTERM after step 1; checkpoint written. Run the same command to resume.",
    ], err[-3000:]
    assert _checkpoints(run) == ["step-1"]
    assert [r["step"] for r in metrics(run)] == [1] and metrics(run, split="eval") == []  # the cut eval: no row


# --- checkpoint writing ----------------------------------------------------------------------

# ``llmft`` whose step-2 checkpoint takes 3 s more once its files are written (``RunHooks``, the
# tests' instrumentation: tests/instrumented.py), with a marker file saying the save is under way.
SLOW_SAVE = """
import os, sys, time
from pathlib import Path
from llmft.training.run import RunHooks, install_hooks

def before_commit(step, rank):
    if step == 2:
        Path(os.environ["STOP_TEST_MARKER"]).write_text("saving")
        time.sleep(3)

install_hooks(RunHooks(before_commit=before_commit))
from llmft.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_a_checkpoint_save_finishes_it_and_exits_75_without_another_step(tmp_path):
    recipe = write_recipe(tmp_path, train__max_steps=6, checkpoint__every_steps=2)
    (tmp_path / "slow_save.py").write_text(SLOW_SAVE)
    marker = tmp_path / "saving"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "slow_save.py"), "train", str(recipe)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
        env=_env(STOP_TEST_MARKER=str(marker)),
    )  # fmt: skip
    _wait_for(proc, marker.exists, "the step-2 save")
    err, took = _stop(proc)
    assert proc.returncode == 75, err[-3000:]
    assert _sigterm_lines(err) == [
        "[llmft] SIGTERM received: finishing the checkpoint being written, then exiting",
        "[llmft] stopped by SIGTERM after step 2; checkpoint written. Run the same command to resume.",
    ], err[-3000:]
    run = tmp_path / "run"
    assert _checkpoints(run) == ["step-2"]  # the save the stop found, and no step after it
    assert (run / "checkpoints" / "step-2" / "COMPLETE").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert [r["step"] for r in metrics(run)] == [1, 2]


# --- export ----------------------------------------------------------------------------------

# ``llmft`` whose safetensors reads take 2 s a tensor (a tiny model exported as slowly as a large
# one), writing a marker at each: the signal comes while the export streams the weights.
SLOW_READ = """
import os, sys, time
from pathlib import Path
import safetensors

real = safetensors.safe_open

class Slow:
    def __init__(self, *args, **kwargs):
        self.file = real(*args, **kwargs)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_tensor(self, key):
        Path(os.environ["STOP_TEST_MARKER"]).write_text(key)
        time.sleep(2.0)
        return self.file.get_tensor(key)

safetensors.safe_open = Slow
from llmft.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_sigterm_during_export_removes_the_partial_output_and_exits_75(tmp_path):
    recipe = write_recipe(tmp_path, train__max_steps=1)
    trained = subprocess.run(
        [sys.executable, "-m", "llmft", "train", str(recipe)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    run, out = tmp_path / "run", tmp_path / "exports" / "model"
    before = _tree(run / "checkpoints")
    (tmp_path / "slow_read.py").write_text(SLOW_READ)
    marker = tmp_path / "reading"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "slow_read.py"), "export", str(run), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
        env=_env(STOP_TEST_MARKER=str(marker)),
    )  # fmt: skip
    _wait_for(proc, marker.exists, "the weights being streamed")
    err, took = _stop(proc, bound=15)  # one tensor's read (2 s), where the whole export takes 20 x 2 s
    assert proc.returncode == 75, err[-3000:]
    lines = [line for line in err.splitlines() if "SIGTERM" in line or "export stopped" in line]
    assert lines == [
        "SIGTERM received: stopping the export; its partial output is removed, and the same command starts it again",
        f"export stopped: {out} was not written (its partial output is removed); {run / 'checkpoints' / 'step-1'} "
        "is untouched",
    ], err[-3000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no .tmp-model, no consolidation scratch
    assert _tree(run / "checkpoints") == before
    again = subprocess.run(
        [sys.executable, "-m", "llmft", "export", str(run), "--out", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
