"""The router's balancing loss under sequence parallelism (llmft/model/moe.py; docs/moe.md):
``distributed.sequence_parallel: 2`` on 2 ranks, each rank's router seeing a slice of every
sequence, against one process with whole sequences: the same first-step gradients (<= 1e-5
relative), the same weights after three SGD steps, and the same loss, balancing loss and expert
load every step, padding excluded (the slices carry the attention mask as ``token_mask``), on
FSDP2 and DDP (packed rows of odd length: the tail that divides them is left out), with a tiny ``qwen3_moe`` and a coefficient that matters (0.5); and on 4 ranks, two
sequence groups of 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the tiny families

from helpers import metrics  # noqa: E402
from test_moe import FAMILIES  # noqa: E402
from test_sequence_parallel import _matches_one_process  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MOE = [f"model.config={json.dumps(FAMILIES['qwen3_moe'])}", "moe.aux_loss_coef=0.5"]
ROWS = ("aux/moe_balance", "moe/load_max_over_mean", "moe/load_max_over_mean_avg", "moe/router_entropy")


def _aux_rows_match(tmp_path) -> None:
    rows, ref = metrics(tmp_path / "sp"), metrics(tmp_path / "one")
    assert len(rows) == len(ref) == 3
    for got, want in zip(rows, ref, strict=True):
        assert want["aux/moe_balance"] > 0.1 * want["loss"]  # a term that matters
        for key in ROWS:
            assert got[key] == pytest.approx(want[key], rel=1e-5), key


# packed rows of 63 tokens: each rank's slice of 32 ends with a tail added to divide the row, left out
CASES = {
    "fsdp": ["distributed.engine=fsdp"],
    "ddp_packed_odd": ["distributed.engine=ddp", "data.packing=true", "data.max_seq_len=63"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_balancing_loss_over_sequence_slices_equals_one_process(tmp_path, case):
    keys = [*CASES[case], *MOE]
    _matches_one_process(tmp_path, keys, ["distributed.sequence_parallel=2", "batch.micro_batch_size=2"], nproc=2)
    _aux_rows_match(tmp_path)


@pytest.mark.extended  # 4 ranks on 2 cores; CI runs the 2-rank cases
def test_balancing_loss_over_two_sequence_groups_equals_one_process(tmp_path):
    keys = ["distributed.engine=fsdp", *MOE]
    _matches_one_process(tmp_path, keys, ["distributed.sequence_parallel=2", "batch.micro_batch_size=1"], nproc=4)
    _aux_rows_match(tmp_path)
