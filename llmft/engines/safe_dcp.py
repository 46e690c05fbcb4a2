"""Reading torch.distributed.checkpoint (DCP) folders without running code from them (docs/design.md G7).

DCP writes its ``.metadata`` with ``pickle.dump`` and its ``FileSystemReader`` reads it back with
a plain ``pickle.load``: a crafted ``.metadata`` runs whatever it likes on ``llmft export`` and on
resume. Its data files hold tensors (read with ``weights_only=True``) and, for non-tensor values
(optimizer hyperparameters), small ``torch.save`` blobs that the default planner reads with
``weights_only=False``. Here:

- ``SafeReader.read_metadata`` unpickles with ``MetadataUnpickler``, which resolves only the
  classes DCP metadata is made of (``METADATA_GLOBALS``: found by loading the metadata of
  llmft's FSDP2 checkpoints, full and LoRA, fp32 and bf16, with and without optimizer state)
  and any ``torch`` dtype; anything else is refused, naming the file and the global.
- ``SafePlanner.load_bytes`` reads the non-tensor values with ``weights_only=True``.

``load`` is ``dcp.load`` with both; every DCP load in llmft goes through it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem

from llmft.checkpoint.safe_load import refused, torch_load
from llmft.errors import UserError

METADATA_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.Size",
        "torch.serialization._get_layout",  # maps a layout's name to torch.strided & co.
        "pathlib.PosixPath",  # StorageMeta.checkpoint_id
        "pathlib.PurePosixPath",
    }
)


class MetadataUnpickler(pickle.Unpickler):
    """Resolves only ``METADATA_GLOBALS`` and torch dtypes; anything else is refused."""

    def __init__(self, file, path: str | os.PathLike) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if qualified not in METADATA_GLOBALS:
            raise refused(
                self.path,
                f"this DCP metadata file names the Python global {qualified}, which DCP metadata never holds; "
                "unpickling it could run code",
            )
        return super().find_class(module, name)


def read_metadata_file(path: str | os.PathLike) -> Any:
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f, path).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
            raise refused(path, f"not a readable DCP metadata file ({type(e).__name__}: {e})") from None
    _check_relative_paths(metadata, path)
    return metadata


def _check_relative_paths(metadata: Any, path: str | os.PathLike) -> None:
    """The data files the metadata names are plain names in its own folder: ``FileSystemReader``
    opens ``folder / relative_path``, and ``../`` or an absolute path would read outside it."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise refused(path, "not a readable DCP metadata file (it has no storage index)")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
            raise refused(path, f"names the data file {str(name)[:80]!r}, which is not a file of its own folder")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = read_metadata_file(path)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def __init__(self, checkpoint_id: str | os.PathLike) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes, with weights_only=True instead of False.
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        obj = torch_load(value, name=f"{self.checkpoint_id} (the value of {fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state: dict[str, Any], checkpoint_id: str | os.PathLike, *, no_dist: bool = False) -> None:
    """``dcp.load`` with the restricted metadata reader and planner.

    DCP wraps what its reader raises into a ``CheckpointException`` (or, for the metadata, an
    assertion text): the metadata is checked here first, and a refusal from the planner is
    raised as the ``UserError`` it is.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = Path(checkpoint_id) / ".metadata"
    if metadata.is_file():
        read_metadata_file(metadata)  # a refusal here is the user's error message, whole
    try:
        dcp.load(
            state,
            checkpoint_id=str(checkpoint_id),
            storage_reader=SafeReader(str(checkpoint_id)),
            planner=SafePlanner(checkpoint_id),
            no_dist=no_dist,
        )
    except CheckpointException as e:
        for failure in e.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback summary)
            if isinstance(cause, UserError):
                raise cause from None
        raise
