"""``TokenDataset``: rows of token ids as flat arrays, written to and memory-mapped from a cache entry.

This is what a rank reads of cached data: ``TokenDataset.open`` maps an entry's Arrow file with
numpy alone, so N ranks (and their DataLoader workers) share one copy of the tokens in the page cache.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from llmft.data.arrays import IGNORE_INDEX, positions
from llmft.errors import Problem, UserError

FIELD_PREFIX = "field:"  # the Arrow column of a record field (``ObjectiveSpec.fields``)
RECORD_COLUMN = "record"  # the Arrow column of a row's whole record (prompt rows): its UTF-8 JSON bytes
Row = tuple["list[int] | np.ndarray", "list[int] | np.ndarray", "list[int] | np.ndarray | None"]


class TokenDataset:
    """Rows of token ids, labels and (packed rows only) position ids, as flat arrays plus offsets.

    Labels are stored as a one-byte target mask (a label is either the token
    itself or IGNORE_INDEX) and position ids as each packed row's sequence
    lengths, so a token costs 5 bytes. ``open`` memory-maps a cache file:
    every process (ranks, DataLoader workers) shares the same pages.

    An item is a row as arrays, never as Python lists: a 1M-token row costs its bytes (the ids are
    a view of the map, labels 4 bytes a token, position ids 8), not a million int objects.

    Record fields (``ObjectiveSpec.fields``) are stored as one float64 per unpacked row, or per
    segment of a packed row, in a ``field:<name>`` column; an item carries them per token as
    ``item["fields"][name]`` (each token its record's number, 0 on a packed row's padded tail).
    Rows without fields have no such column and no ``fields`` key.

    Prompt rows (online RL, ``kinds/prompts.py``) keep their whole parsed record as UTF-8 JSON bytes in a
    ``record`` column (a list of uint8 per row, mapped like the tokens); an item then carries it as
    ``item["record"]``, a dict decoded from those bytes when the item is read.
    """

    def __init__(self, rows: list[Row]) -> None:
        """Rows given in memory (tests, small data): ``(input_ids, labels, position_ids or None)`` each."""
        lengths = np.array([len(ids) for ids, _, _ in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = _flat([r[0] for r in rows], np.int32)
        labels = _flat([r[1] for r in rows], np.int64)
        target = labels != IGNORE_INDEX
        assert (labels[target] == ids[target]).all(), "a label is either its token or IGNORE_INDEX"
        packed = bool(rows) and rows[0][2] is not None
        segments = seg_offsets = None
        if packed:
            segs = [_segments_of(np.asarray(pos)) for _, _, pos in rows]
            seg_offsets = np.concatenate([[0], np.cumsum([len(s) for s in segs])]).astype(np.int64)
            segments = _flat(segs, np.int32)
        self._set(ids, target.astype(np.uint8), offsets, segments, seg_offsets)

    @classmethod
    def empty(cls, records: bool = False) -> TokenDataset:
        """No rows (a stream block with nothing usable); ``records``: rows that would keep their record."""
        no_records = (np.zeros(1, np.int64), np.zeros(0, np.uint8)) if records else None
        return cls.from_arrays(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64), records=no_records)

    @classmethod
    def from_arrays(
        cls,
        input_ids: np.ndarray,
        target: np.ndarray,
        offsets: np.ndarray,
        segments: np.ndarray | None = None,
        segment_offsets: np.ndarray | None = None,
        fields: dict[str, np.ndarray] | None = None,
        records: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> TokenDataset:
        """``records``: (offsets, uint8 values) of each unpacked row's record as UTF-8 JSON bytes."""
        self = cls.__new__(cls)
        self._set(input_ids, target, offsets, segments, segment_offsets, fields, records)
        return self

    def _set(self, ids, target, offsets, segments, seg_offsets, fields=None, records=None) -> None:
        self._input_ids, self._target, self._offsets = ids, target, offsets
        self._segments, self._seg_offsets = segments, seg_offsets
        self.packed = segments is not None
        self._fields: dict[str, np.ndarray] = dict(fields or {})  # per row, or per segment when packed
        for name, v in self._fields.items():
            want = len(segments) if self.packed else len(offsets) - 1
            assert len(v) == want, f"field {name}: {len(v)} values for {want} rows or segments"
        self._records = records  # (offsets, UTF-8 JSON bytes), one record per row; None: no records
        if records is not None:
            assert not self.packed, "records are kept for unpacked rows only"
            assert len(records[0]) == len(offsets), f"{len(records[0]) - 1} records for {len(offsets) - 1} rows"
        self.path: Path | None = None

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        ids = self._input_ids[lo:hi]  # a read-only view of the map: no copy
        item = {
            "input_ids": ids,
            "labels": np.where(self._target[lo:hi] != 0, ids, np.int32(IGNORE_INDEX)).astype(np.int32, copy=False),
            "position_ids": None,
        }
        if self._segments is not None:
            item["position_ids"] = positions(self._segments[self._seg_offsets[i] : self._seg_offsets[i + 1]])
        if self._fields:
            item["fields"] = self._field_tokens(i, hi - lo)
        if self._records is not None:
            item["record"] = self.record(i)
        return item

    def record(self, i: int) -> dict[str, Any]:
        """Row ``i``'s record (prompt rows), decoded from its JSON bytes."""
        assert self._records is not None, "these rows keep no records"
        offsets, values = self._records
        return json.loads(values[int(offsets[i]) : int(offsets[i + 1])].tobytes().decode("utf-8"))

    @property
    def has_records(self) -> bool:
        return self._records is not None

    def _field_tokens(self, i: int, n: int) -> dict[str, np.ndarray]:
        """Row ``i``'s record fields per token (``n`` tokens): each token its record's number."""
        if not self.packed:
            return {name: np.full(n, v[i], dtype=np.float64) for name, v in self._fields.items()}
        lo, hi = int(self._seg_offsets[i]), int(self._seg_offsets[i + 1])
        lengths = np.asarray(self._segments[lo:hi], dtype=np.int64)
        return {name: np.repeat(v[lo:hi], lengths) for name, v in self._fields.items()}

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self._fields)

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def write(self, path: Path) -> None:
        """One Arrow IPC stream file (``datasets.Dataset.from_file`` opens it too), and beside it
        ``<name>.layout.json``: where each column's buffers lie in the file, so that ``open`` maps
        them with numpy alone (importing pyarrow and pandas costs a rank ~66 MiB of RSS)."""
        import pyarrow as pa  # here, not at the top: a rank that only reads rows never imports it

        columns = {
            "input_ids": _list_array(self._offsets, self._input_ids),
            "target": _list_array(self._offsets, self._target),
        }
        if self._segments is not None:
            columns["segments"] = _list_array(self._seg_offsets, self._segments)
        at = self._seg_offsets if self.packed else np.arange(len(self) + 1, dtype=np.int64)
        for name, v in self._fields.items():
            columns[FIELD_PREFIX + name] = _list_array(at, np.asarray(v, dtype=np.float64))
        if self._records is not None:
            columns[RECORD_COLUMN] = _list_array(self._records[0], np.asarray(self._records[1], dtype=np.uint8))
        table = pa.table(columns)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=max(1, len(self)))
        _layout_path(path).write_text(json.dumps(_layout(path)))

    @classmethod
    def open(cls, path: Path) -> TokenDataset:
        """Memory-map a file written by ``write``: no copy, no pyarrow; pages load as rows are read."""
        path = Path(path)
        layout = json.loads(_layout_path(path).read_text())
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != layout["bytes"]:
                raise UserError(
                    Problem(
                        str(path),
                        f"is {size} bytes, but its layout says {layout['bytes']}: the cache entry was changed",
                        f"Delete the entry {path.parent} so that it is built again.",
                    )
                )
            view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

        def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
            col = layout["columns"].get(name)
            if col is None:  # no record batch: an empty dataset
                return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32)
            (o_at, o_n), (v_at, v_n, v_type) = col["offsets"], col["values"]
            offsets = np.frombuffer(view, dtype=np.int64, count=o_n, offset=o_at)
            values = np.frombuffer(view, dtype=np.dtype(v_type), count=v_n, offset=v_at)
            assert offsets[0] == 0 and offsets[-1] == v_n, f"{path}: {name} offsets do not match its values"
            return offsets, values

        offsets, ids = flat("input_ids")
        _, target = flat("target")
        segs = flat("segments") if layout["segments"] else (None, None)
        named = [c for c in layout["columns"] if c.startswith(FIELD_PREFIX)]
        fields = {c[len(FIELD_PREFIX) :]: flat(c)[1] for c in named}
        records = None
        if layout.get("records"):  # prompt rows (no record batch: no rows, and no records)
            empty = (np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.uint8))
            records = flat(RECORD_COLUMN) if RECORD_COLUMN in layout["columns"] else empty
        self = cls.from_arrays(ids, target, offsets, segs[1], segs[0], fields, records)
        self.path = path
        return self

    def __reduce__(self):
        # Spawned DataLoader workers re-open the memory map instead of receiving a copy of the tokens.
        if self.path is not None:
            return (TokenDataset.open, (self.path,))
        return (
            TokenDataset.from_arrays,
            (
                self._input_ids,
                self._target,
                self._offsets,
                self._segments,
                self._seg_offsets,
                self._fields,
                self._records,
            ),
        )


def _segments_of(pos: np.ndarray) -> np.ndarray:
    """The sequence lengths of a row from its position ids (a sequence starts where a position is 0)."""
    return np.diff(np.append(np.flatnonzero(pos == 0), len(pos)))


def _flat(parts: list, dtype: type) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype)


def _layout_path(path: Path) -> Path:
    return Path(path).with_suffix(".layout.json")


def _layout(path: Path) -> dict[str, Any]:
    """Byte offset and length of each column's offsets and values in the Arrow file at ``path``."""
    import pyarrow as pa  # only the writer: ranks that read rows stay without it

    source = pa.memory_map(str(path), "r")
    base = source.read_buffer(1).address if source.size() else 0
    source.seek(0)
    table = pa.ipc.open_stream(source).read_all()
    columns: dict[str, Any] = {}
    for name in table.column_names:
        column = table.column(name)
        if column.num_chunks == 0:
            continue
        assert column.num_chunks == 1, f"{path}: {column.num_chunks} chunks"
        arr = column.chunk(0)
        assert arr.offset == 0 and arr.values.offset == 0 and arr.null_count == 0, f"{path}: {name} is sliced"
        _, offsets, _, values = arr.buffers()
        columns[name] = {
            "offsets": [offsets.address - base, len(arr) + 1],
            "values": [values.address - base, len(arr.values), arr.type.value_type.to_pandas_dtype().__name__],
        }
    return {
        "bytes": source.size(),
        "columns": columns,
        "segments": "segments" in table.column_names,
        "records": RECORD_COLUMN in table.column_names,
    }


def _list_array(offsets: np.ndarray, values: np.ndarray):
    import pyarrow as pa  # only the writer: ranks that read rows stay without it

    return pa.LargeListArray.from_arrays(pa.array(np.asarray(offsets, dtype=np.int64)), pa.array(values))
