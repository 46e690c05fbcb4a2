"""Is a checkpoint whole? Cheap structural checks of every file a resume or an export reads.

A checkpoint can be complete (``COMPLETE`` written last) and still be damaged afterwards: a file
truncated by a full disk on a copy, a partial rsync, a bad block. ``verify`` reads only headers,
sizes and indexes, never the tensors:

- ``COMPLETE`` holds ``{"step": N}`` for its own ``step-N``; ``trainer_state.json``,
  ``recipe.yaml`` and ``plan.yaml`` (absent in older checkpoints) parse;
- safetensors files: the JSON header parses and the data it describes fits the file exactly;
- ``torch.save`` files (optimizer, RNG, DeepSpeed's): their zip index is intact (it is written
  last, so a truncated file has none);
- DCP folders: ``.metadata`` and every data file it names are present and not empty.

A damaged checkpoint raises ``DamagedCheckpoint`` naming the file; ``llmft train`` then resumes
from the previous complete one (docs/checkpoints.md).
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import yaml

from llmft.checkpoint.layout import (
    COMPLETE,
    DCP_DIR,
    DS_DIR,
    MODEL_DIR,
    OPTIMIZER_FILE,
    PLAN_FILE,
    RECIPE_FILE,
    RNG_DIR,
    STEP_RE,
    TrainerState,
)
from llmft.errors import Problem, UserError


class DamagedCheckpoint(UserError):
    """A complete checkpoint with a file that cannot be what llmft wrote."""


def _damaged(path: Path, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        Problem(
            str(path),
            f"is damaged: {what}",
            "Resume from an earlier checkpoint (checkpoint.resume=auto skips damaged ones), or restore the file.",
        )
    )


def verify(step_dir: Path) -> None:
    """Raise ``DamagedCheckpoint`` naming the first file of ``step_dir`` that is not whole."""
    step_dir = Path(step_dir)
    _check_marker(step_dir)
    try:
        TrainerState.read(step_dir)
    except UserError as e:
        raise _damaged(step_dir / "trainer_state.json", e.problems[0].what) from None
    for name in (RECIPE_FILE, PLAN_FILE):
        if name == PLAN_FILE and not (step_dir / name).exists():  # older checkpoints have none
            continue
        try:
            yaml.safe_load((step_dir / name).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise _damaged(step_dir / name, f"{type(e).__name__}: {e}".splitlines()[0]) from None
    for path in sorted((step_dir / RNG_DIR).glob("*.pt")):
        check_zip(path)
    for path in sorted((step_dir / MODEL_DIR).glob("*.safetensors")):
        check_safetensors(path)
    for path in sorted((step_dir / MODEL_DIR).glob("*.json")):
        check_json(path)
    if (step_dir / OPTIMIZER_FILE).exists():
        check_zip(step_dir / OPTIMIZER_FILE)
    if (step_dir / DCP_DIR).is_dir():
        check_dcp(step_dir / DCP_DIR)
    for path in sorted((step_dir / DS_DIR).rglob("*.pt")):
        check_zip(path)


def _check_marker(step_dir: Path) -> None:
    marker = step_dir / COMPLETE
    m = STEP_RE.match(step_dir.name)
    try:
        step = json.loads(marker.read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _damaged(marker, f"not the marker llmft writes ({type(e).__name__})") from None
    if m is None or step != int(m.group(1)):
        raise _damaged(marker, f"says step {step}, but the folder is {step_dir.name}")


def check_json(path: Path) -> None:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _damaged(path, f"not valid JSON ({e})") from None


def check_safetensors(path: Path) -> None:
    """The header parses and its tensors end exactly where the file does."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, struct.error) as e:
        raise _damaged(path, f"unreadable safetensors header ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise _damaged(path, f"{size} bytes on disk, {8 + header_len + end} expected (truncated or appended)")


def check_zip(path: Path) -> None:
    """A ``torch.save`` file: its zip index (written last) is intact and every entry lies in the file."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    raise zipfile.BadZipFile(f"{info.filename} runs past the end of the file")
    except (OSError, zipfile.BadZipFile) as e:
        raise _damaged(path, f"not a whole torch.save file ({e}); {size} bytes on disk") from None


def check_dcp(dcp_dir: Path) -> None:
    metadata = dcp_dir / ".metadata"
    if not metadata.is_file() or metadata.stat().st_size == 0:
        raise _damaged(metadata, "missing or empty (DCP's index of the shards)")
    for data in sorted(dcp_dir.glob("*.distcp")):
        if data.stat().st_size == 0:
            raise _damaged(data, "empty shard file")
