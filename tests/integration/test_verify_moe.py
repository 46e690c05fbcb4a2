"""``llmft verify`` with the router's load-balancing loss of a mixture of experts (docs/moe.md).

A tiny fp32 ``qwen3_moe`` (2 layers, 8 experts, top-2) built from ``model.config``, balancing loss
weight 0.5, on records of very different lengths (padding in every micro-batch), 2 emulated ranks x
micro 2 x accumulation 2. With ``moe.balance: global_batch`` the split's balancing loss and gradients
are the big batch's; with ``micro_batch`` (the control) verify fails and names the term.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import write_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the tiny families
from test_moe import FAMILIES  # noqa: E402

from llmft.cli import main

QWEN3_MOE = FAMILIES["qwen3_moe"]
SPLIT = ["moe.aux_loss_coef=0.5", "batch.micro_batch_size=2", "distributed.nproc_per_node=2"]
AUX_LINE = re.compile(
    r"^aux:     aux/moe_balance, big batch ([\d.]+), llmft accumulated ([\d.]+), "
    r"naive per-micro-batch ([\d.]+) \(added to the loss\)$",
    re.M,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return str(write_recipe(tmp_path_factory.mktemp("verify-moe"), model__config=QWEN3_MOE))


def test_the_global_batch_balancing_loss_passes_and_is_reported(recipe, capsys):
    assert main(["verify", recipe, *SPLIT, "moe.balance=global_batch"]) == 0
    out = capsys.readouterr().out
    assert "micro 2 x accumulation 2 x data-parallel 2 = global 8" in out
    (big, llmft, naive) = map(float, AUX_LINE.search(out).groups())
    assert big > 0.5  # coefficient 0.5 x E sum f P, about 1 when balanced: a term that matters
    assert llmft == big  # to the 6 decimals printed
    assert abs(naive - big) > 1e-4  # per-micro-batch balancing (what HF computes) is another value
    assert "\nPASS: largest relative difference " in out


def test_the_micro_batch_balancing_loss_fails_naming_the_term(recipe, capsys):
    """The control: the per-micro-batch loss depends on the split, and verify says so."""
    assert main(["verify", recipe, *SPLIT, "moe.balance=micro_batch"]) == 1
    out, err = capsys.readouterr()
    big, llmft, _ = map(float, AUX_LINE.search(out).groups())
    assert abs(llmft - big) > 1e-4
    assert "\nFAIL: largest relative difference " in out
    found = re.search(
        r"llmft verify: error: the auxiliary term aux/moe_balance accumulated over the split is ([\d.]+), "
        r"the big batch's ([\d.]+): relative difference (\S+), more than --tolerance 0.0001 \(the accumulated "
        r"gradient differs by (\S+)\)\. A term computed per micro-batch depends on the split: for the router's "
        r"balancing loss use moe.balance: global_batch \(docs/moe.md\)\.",
        err,
    )
    assert found, err
    assert float(found[1]) == llmft and float(found[2]) == big  # as the table prints them
    assert float(found[3]) > 1e-4 and float(found[4]) > 1e-2  # the value and the gradient both differ
    lines = out.splitlines()
    worst = lines[next(i for i, line in enumerate(lines) if line.startswith("all 25 trainable tensors")) + 1]
    assert worst.startswith("model.layers.") and ".mlp.gate.weight " in worst  # a router's gradient, the worst
