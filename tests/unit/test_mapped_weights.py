"""A CPU run's frozen shards straight from the weight files (llmft/model/meta.py ``mapped_rows``,
``mapped_flat``): the file's own pages, equal to what a copy reads, and a write never reaches the file."""

from pathlib import Path

import pytest
import torch
from mapped import in_weight_file
from safetensors import SafetensorError
from safetensors.torch import save_file

from llmft.model.meta import SafetensorsWeights


def _weights(tmp_path: Path) -> tuple[SafetensorsWeights, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(6, 4),
        "half": torch.randn(6, 4).to(torch.bfloat16),
        "odd": torch.randn(3, 5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = dict.fromkeys(tensors, "model.safetensors")
    return SafetensorsWeights(tmp_path, files, {k: k for k in tensors}), tensors


def test_rows_are_the_files_pages_and_equal_a_read(tmp_path):
    weights, tensors = _weights(tmp_path)
    index = (slice(2, 5), slice(0, 4))
    rows = weights.mapped_rows("w", index, torch.Size((6, 4)), torch.float32)
    assert torch.equal(rows, tensors["w"][2:5]) and torch.equal(rows, weights.read("w", index, torch.Size((6, 4))))
    assert in_weight_file(rows.data_ptr(), tmp_path / "model.safetensors")
    flat = weights.mapped_flat("odd", torch.Size((3, 5)), torch.float32, 4, 13)
    assert torch.equal(flat, tensors["odd"].reshape(-1)[4:13])


def test_a_write_stays_in_this_process(tmp_path):
    weights, tensors = _weights(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    rows = weights.mapped_rows("w", (slice(0, 6), slice(0, 4)), torch.Size((6, 4)), torch.float32)
    rows.add_(1.0)
    assert torch.equal(rows, tensors["w"] + 1.0)
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_what_cannot_be_mapped_is_none(tmp_path):
    weights, _ = _weights(tmp_path)
    shape = torch.Size((6, 4))
    assert weights.mapped_rows("half", (slice(0, 3), slice(0, 4)), shape, torch.float32) is None  # stored bf16
    assert weights.mapped_rows("w", (slice(0, 3), slice(0, 2)), shape, torch.float32) is None  # not whole rows
    assert weights.mapped_rows("w", (slice(0, 3), slice(0, 4)), torch.Size((4, 6)), torch.float32) is None  # shape
    assert weights.mapped_flat("w", shape, torch.float32, 20, 30) is None  # past the end


def test_a_damaged_file_fails_as_a_read_of_it_does(tmp_path):
    """A truncated weight file: the mapping reports safetensors' own error, as ``read`` does (the
    message the load's error handling names the damaged file with), not a torch storage error."""
    weights, _ = _weights(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    index, shape = (slice(0, 3), slice(0, 4)), torch.Size((6, 4))
    with pytest.raises(SafetensorError, match="incomplete metadata, file not fully covered") as read:
        weights.read("w", index, shape)
    with pytest.raises(SafetensorError) as mapped:
        weights.mapped_rows("w", index, shape, torch.float32)
    assert str(mapped.value) == str(read.value)
