"""``llmft verify``: the accumulated gradient of the configured split equals the big batch's.

A tiny Llama (hidden 64, 2 layers, vocab 320, byte tokenizer) on prompt/completion records of
very different lengths, global batch 8. Torch runs on one thread: the test machines have two
shared cores, and oversubscribed threads make the tiny backward passes ten times slower.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, write_recipe

from llmft.cli import main
from llmft.errors import UserError
from llmft.plan.batch import BatchPlan
from llmft.training.verify import _big_batch_grads, check_gradients, load_for_verify, render, verify

TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """micro 2 x accumulation 4 on one process (global 8)."""
    return str(write_recipe(tmp_path_factory.mktemp("verify"), batch__micro_batch_size=2))


CASES = {
    "micro2-acc4": ([], (2, 4, 1)),
    "dp2": (["distributed.nproc_per_node=2"], (2, 2, 2)),
    "lora": (["peft.method=lora", "peft.r=4"], (2, 4, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_gives_the_big_batch_gradient(recipe, case):
    overrides, (micro, acc, dp) = CASES[case]
    result = check_gradients(load_for_verify(recipe, overrides))

    plan = result.plan
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.dp_size) == (micro, acc, dp)
    assert [len(rank) for rank in result.targets] == [acc] * dp
    assert len(set(t for rank in result.targets for t in rank)) > 1  # lengths differ: naive averaging is wrong
    assert 0 < result.max_rel_diff < 1e-5  # float rounding only
    assert result.losses["llmft"] == pytest.approx(result.losses["big"], rel=1e-6)
    assert result.overall.naive > 100 * TOLERANCE  # what per-micro-batch means would have given

    text = render(result, TOLERANCE)
    assert f"micro {micro} x accumulation {acc} x data-parallel {dp} = global 8" in text
    assert f"would be off by {result.overall.naive:.2e}" in text
    assert text.splitlines()[-1].startswith(f"PASS: largest relative difference {result.max_rel_diff:.2e}")
    if dp > 1:
        assert "2 ranks emulated in one process" in text
    if case == "lora":  # lora_A gets exactly zero gradient while lora_B is zero: compared, not divided by 0
        zero = [t for t in result.tensors if t.ref_norm == 0]
        assert zero and all(t.llmft == 0 for t in zero)


def test_a_tolerance_below_the_difference_fails(recipe, capsys):
    result = check_gradients(load_for_verify(recipe))
    diff = result.max_rel_diff
    assert isinstance(diff, float) and 0 < diff < 1e-5

    assert verify(recipe, tolerance=diff / 4) == 1
    out, err = capsys.readouterr()
    assert "FAIL: largest relative difference" in out
    assert "gradient accumulation is not equivalent to the big batch within tolerance" in err
    assert f"more than --tolerance {diff / 4:g}" in err


def test_cli_exits_zero_and_prints_the_table(recipe):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmft", "verify", recipe, "--samples", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "micro 2 x accumulation 2 x data-parallel 1 = global 4" in proc.stdout
    assert "--samples: the first 4 of global batch 8" in proc.stdout
    assert "parameter" in proc.stdout and "naive" in proc.stdout
    assert "\nPASS: " in proc.stdout


@pytest.mark.parametrize("samples", ["3", "16", "0"])
def test_samples_must_keep_the_split_whole(recipe, samples, capsys):
    code = main(["verify", recipe, "distributed.nproc_per_node=2", "--samples", samples])
    err = capsys.readouterr().err
    assert code == UserError.exit_code
    assert f"--samples: {samples} cannot keep the split whole" in err
    assert "multiple of micro 2 x data-parallel 2 = 4, at most the global batch 8. Use one of 4, 8." in err


def test_a_big_batch_that_does_not_fit_points_to_samples():
    class OutOfMemory(torch.nn.Module):
        def forward(self, **batch):
            raise torch.OutOfMemoryError("CUDA out of memory")

    plan = BatchPlan(16, 2, 4, 2)
    for items in ("sequences", "pairs"):
        with pytest.raises(UserError) as e:
            _big_batch_grads(OutOfMemory(), {}, lambda batch: OutOfMemory()(**batch), plan, items)
        assert f"the big batch of 16 {items} does not fit" in str(e.value)
        assert "--samples 4, 8" in str(e.value)


# --- preference objectives: the count is pairs -----------------------------------------------------


@pytest.fixture(scope="module")
def pairs_recipe(tmp_path_factory):
    """The shipped demo pairs (data/preference), micro 2 x accumulation 4 on one process (global 8 pairs)."""
    tmp = tmp_path_factory.mktemp("verify-pairs")
    data = tmp / "pairs.jsonl"
    data.write_text("".join((ROOT / "data/preference/train.jsonl").read_text().splitlines(keepends=True)[:24]))
    return str(write_recipe(tmp, data__train=str(data), batch__micro_batch_size=2))


PAIR_CASES = {
    "dpo-lora": ["train.objective=dpo", "peft.method=lora", "peft.r=4", "distributed.nproc_per_node=2"],
    "dpo-full": ["train.objective=dpo", "preference.loss_type=ipo"],
    "reward-lora": ["train.objective=reward", "peft.method=lora", "peft.r=4", "distributed.nproc_per_node=2"],
    "reward-full": ["train.objective=reward"],
}


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_preference_splits_give_the_big_batch_gradient(pairs_recipe, case):
    result = check_gradients(load_for_verify(pairs_recipe, PAIR_CASES[case]))
    dp = result.plan.dp_size
    assert result.counts == "pairs" and result.targets == [[2] * (4 // dp)] * dp  # pairs per micro-batch
    assert 0 < result.max_rel_diff < 1e-5
    assert result.losses["llmft"] == pytest.approx(result.losses["big"], rel=1e-6)
    # Full micro-batches hold the same number of pairs: per-micro-batch means are exact here too.
    assert result.overall.naive < 1e-5
    text = render(result, TOLERANCE)
    assert "pairs:   8 pairs; per micro-batch " in text
    assert f"loss:    {case.split('-')[0]}, big batch " in text
    assert text.splitlines()[-1].startswith("PASS: ")
    if case.startswith("reward"):
        assert any("score" in t.name for t in result.tensors)


def test_a_preference_check_below_its_difference_fails_with_the_pairs_hint(pairs_recipe, capsys):
    over = ["train.objective=reward"]
    diff = check_gradients(load_for_verify(pairs_recipe, over)).max_rel_diff
    assert verify(pairs_recipe, over, tolerance=diff / 4) == 1
    err = capsys.readouterr().err
    assert (
        f"gradient accumulation is not equivalent to the big batch within tolerance: the accumulated gradient "
        f"differs by {diff:.2e}" in err
    )
    assert (
        f"more than --tolerance {diff / 4:g}. In fp32 the difference should be ~1e-6: a larger one means this "
        "model's forward depends on the batch (BatchNorm, MoE capacity limits, padding)" in err
    )


def test_samples_count_pairs(pairs_recipe, capsys):
    code = main(["verify", pairs_recipe, "train.objective=dpo", "distributed.nproc_per_node=2", "--samples", "6"])
    assert code == UserError.exit_code
    err = capsys.readouterr().err
    assert "--samples: 6 cannot keep the split whole: it must be a multiple of micro 2 x data-parallel 2 = 4, " in err
    assert "at most the global batch 8. Use one of 4, 8." in err
