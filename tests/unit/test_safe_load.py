"""Nothing runs that the user did not ask for (docs/design.md G7): the readers of DCP
metadata and values, DeepSpeed pickles and weights_only files refuse what would run code."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from llmft.checkpoint.safe_load import torch_load
from llmft.engines import safe_dcp
from llmft.engines.safe_deepspeed import check_deepspeed_files, unexpected_globals
from llmft.errors import UserError


class WritesMarker:
    """Unpickling this writes a file: what a crafted checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def _dcp(tmp_path: Path) -> Path:
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return tmp_path / "dcp"


def test_a_real_dcp_checkpoint_loads_with_tensors_and_plain_values(tmp_path):
    path = _dcp(tmp_path)
    state = {"model": {"w": torch.zeros(2, 3)}, "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    safe_dcp.load(state, path, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert state["optim"]["param_groups"][0]["lr"] == 0.1


def test_dcp_metadata_that_would_run_code_is_refused_and_never_runs(tmp_path):
    path = _dcp(tmp_path)
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    with pytest.raises(UserError) as e:
        safe_dcp.load({"model": {"w": torch.zeros(2, 3)}}, path, no_dist=True)
    assert str(path / ".metadata") in str(e.value)
    assert "names the Python global pathlib.Path.write_text" in str(e.value)
    assert "weights_only=False" not in str(e.value)
    assert not marker.exists()
    # the same file is what torch's own reader runs
    with open(path / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_a_dcp_value_that_would_run_code_is_refused(tmp_path):
    path = _dcp(tmp_path)
    marker = tmp_path / "marker"
    # the optimizer's lr value is a torch.save blob in the data file: replace it by a crafted one
    metadata = safe_dcp.read_metadata_file(path / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn.endswith("lr"))
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(WritesMarker(marker), blob)
    data = path / info.relative_path
    raw = data.read_bytes()
    data.write_bytes(raw[: info.offset] + blob.getvalue() + raw[info.offset + info.length :])
    info.length = len(blob.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=r"optim\.param_groups\.0\.lr.*refused: it holds Python objects"):
        safe_dcp.load({"optim": {"param_groups": [{"lr": 0.0}]}}, path, no_dist=True)
    assert not marker.exists()


def test_weights_only_refusal_names_the_file_and_never_advises_weights_only_false(tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save({"state": WritesMarker(tmp_path / "marker")}, path)
    with pytest.raises(UserError) as e:
        torch_load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: refused: it holds Python objects")
    assert "weights_only=False" not in message and "trust the source" not in message
    assert not (tmp_path / "marker").exists()


def test_deepspeed_files_with_a_foreign_global_are_refused_before_anything_unpickles_them(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    state = tmp_path / "step-1/deepspeed/state"
    state.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "scaler": LossScaler(1.0)}, state / "mp_rank_00_model_states.pt")
    check_deepspeed_files(tmp_path / "step-1")  # DeepSpeed's own loss scaler is on the list
    marker = tmp_path / "marker"
    bad = state / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": WritesMarker(marker)}, bad)
    assert "builtins.getattr" in unexpected_globals(bad)  # torch pickles Path.write_text as getattr(Path, ...)
    with pytest.raises(UserError) as e:
        check_deepspeed_files(tmp_path / "step-1")
    assert f"{bad}: refused: this DeepSpeed file names the Python global(s) builtins.getattr" in str(e.value)
    assert not marker.exists()


def test_a_deepspeed_file_that_is_not_a_torch_zip_is_refused(tmp_path):
    state = tmp_path / "step-1/deepspeed_universal/state/zero/w"
    state.mkdir(parents=True)
    (state / "fp32.pt").write_bytes(pickle.dumps(os.getcwd))
    with pytest.raises(UserError, match="not a torch checkpoint file that can be checked"):
        check_deepspeed_files(tmp_path / "step-1")


def test_every_load_in_llmft_goes_through_the_safe_readers():
    """docs/design.md G7: torch.load only in safe_load.py, DCP loads only in engines/safe_dcp.py,
    DeepSpeed's readers only after check_deepspeed_files (a new reader that bypasses them fails here)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "llmft"
    calls = {r"\btorch\.load\(": "safe_load.py", r"\bdcp\.load\(": "safe_dcp.py", r"\bpickle\.load": "safe_dcp.py"}
    for path in root.rglob("*.py"):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())  # calls, not comments
        code = re.sub(r'"""(.|\n)*?"""', "", code)  # nor docstrings
        for call, home in calls.items():
            if re.search(call, code):
                assert path.name == home, f"{path.relative_to(root)} calls {call} outside {home}"
    deepspeed = (root / "engines" / "deepspeed.py").read_text()

    def body(name: str) -> str:
        return deepspeed.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]

    for opener in ("_module_state", "deepspeed_universal"):
        assert "check_deepspeed_files(" in body(opener), opener
    for reader in ("read_deepspeed", "deepspeed_reader"):  # both read through the checked opener
        assert "_module_state(" in body(reader) and "get_fp32_state_dict" not in body(reader), reader
