"""Read raw records from JSONL / JSON / Parquet files, directories of them, or a save_to_disk dir.

Reading never judges a record's fields (that is ``records.py``); it only turns
bytes into JSON values and remembers where each came from, so that every later
complaint can name ``file:line`` (JSONL, JSON parse errors) or ``file: record i``
(0-based, other formats). A line that is not valid JSON becomes a ``RawRecord``
with an ``error`` so that ``data.on_bad_record`` decides its fate in one place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmft.errors import Problem, UserError

EXTENSIONS = (".jsonl", ".json", ".parquet")
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json")


@dataclass(frozen=True)
class RawRecord:
    where: str  # "file:line" or "file: record i"
    value: Any  # the parsed JSON value (None when error is set)
    error: str | None = None  # why it could not be parsed


def read_records(source: Any, key: str) -> list[RawRecord]:
    """All records of ``source`` (a path or a list of paths), in a deterministic order.

    ``key`` is the recipe key the source came from (``data.train``), used in errors.
    """
    paths = _as_paths(source, key)
    records: list[RawRecord] = []
    for path in paths:
        records.extend(_read_path(path, key))
    return records


def describe(source: Any) -> str:
    """The source as a user wrote it, for messages."""
    if isinstance(source, (str, Path)):
        return str(source)
    return ", ".join(str(p) for p in source)


def _as_paths(source: Any, key: str) -> list[Path]:
    if source is None or source == "" or source == []:
        raise UserError(Problem(key, "is not set", f"Set {key} to a JSONL/JSON/Parquet file or directory."))
    items = [source] if isinstance(source, (str, Path)) else list(source)
    paths = [Path(str(item)).expanduser() for item in items]
    for path in paths:
        if not path.exists():
            raise UserError(
                Problem(key, f"path '{path}' does not exist", f"Check the path (relative to {Path.cwd()}).")
            )
    return paths


def _read_path(path: Path, key: str) -> Iterator[RawRecord]:
    if path.is_dir():
        if all((path / marker).is_file() for marker in _SAVE_TO_DISK_MARKERS):
            yield from _read_saved_dataset(path, key)
            return
        if (path / "dataset_dict.json").is_file():
            raise UserError(_dataset_dict_problem(path, key))
        files = _data_files(path)
        if not files:
            raise UserError(
                Problem(key, f"directory '{path}' holds no .jsonl, .json or .parquet files", "Check the path.")
            )
        for file in files:
            yield from _read_file(file, key)
    else:
        yield from _read_file(path, key)


def _data_files(directory: Path) -> list[Path]:
    """Data files under ``directory`` (recursively), sorted by relative path; hidden entries skipped."""
    found = []
    for file in directory.rglob("*"):
        rel = file.relative_to(directory)
        if file.is_file() and file.suffix in EXTENSIONS and not any(p.startswith(".") for p in rel.parts):
            found.append(rel)
    return [directory / rel for rel in sorted(found, key=lambda r: r.as_posix())]


def _read_file(path: Path, key: str) -> Iterator[RawRecord]:
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        yield from _read_json(path)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise UserError(
            Problem(key, f"'{path}' is not a .jsonl, .json or .parquet file", "Convert it, or rename it if it is one.")
        )


def _read_jsonl(path: Path) -> Iterator[RawRecord]:
    # Bytes, decoded per line: one line of bad UTF-8 is one bad record, not a dead file.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRecord(where, None, f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                yield RawRecord(where, json.loads(line))
            except json.JSONDecodeError as e:
                yield RawRecord(where, None, f"not valid JSON ({e.msg} at column {e.colno})")


def _read_json(path: Path) -> Iterator[RawRecord]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        hint = "; a file with one record per line should be named .jsonl" if e.msg == "Extra data" else ""
        raise UserError(
            Problem(f"{path}:{e.lineno}", f"not valid JSON ({e.msg} at column {e.colno}){hint}", "Fix the file.")
        ) from e
    except UnicodeDecodeError as e:
        raise UserError(Problem(str(path), f"not valid UTF-8 ({e.reason} at byte {e.start})", "Fix the file.")) from e
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        raise UserError(
            Problem(
                str(path),
                f'a .json data file must hold a list of records or {{"data": [...]}}, not a {type(doc).__name__}',
                "Wrap the records in a list, or write one record per line to a .jsonl file.",
            )
        )
    for i, value in enumerate(doc):
        yield RawRecord(f"{path}: record {i}", value)


def _read_parquet(path: Path) -> Iterator[RawRecord]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(Problem(str(path), f"not a readable Parquet file ({e})", "Check the file.")) from e
    for i, value in enumerate(rows):
        yield RawRecord(f"{path}: record {i}", value)


def _read_saved_dataset(path: Path, key: str) -> Iterator[RawRecord]:
    try:
        import datasets
    except ImportError as e:
        raise UserError(
            Problem(key, f"'{path}' is a datasets save_to_disk directory", "pip install datasets to read it.")
        ) from e
    dataset = datasets.load_from_disk(str(path))
    for i, value in enumerate(dataset):
        yield RawRecord(f"{path}: record {i}", value)


def _dataset_dict_problem(path: Path, key: str) -> Problem:
    splits = sorted(p.name for p in path.iterdir() if p.is_dir())
    return Problem(
        key,
        f"'{path}' is a saved DatasetDict with splits {splits}",
        f"Point {key} at one split's directory, e.g. {path / splits[0]}." if splits else "Save a Dataset instead.",
    )
