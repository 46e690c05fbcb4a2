"""Find a source's data and load it as Hugging Face ``datasets`` tables, remembering where each record came from.

A source resolves (``resolve``) to one of

- local files: a file, a directory (its data files recursively, sorted by
  relative path, hidden entries skipped) or a glob. JSONL and JSON files are
  split into records by llmft itself, one raw JSON string per record, so that
  a bad line is one bad record at ``file:line`` and records of different
  shapes may share a file (Arrow's JSON reader would need one schema and
  fails a whole file on one bad line); they are parsed in the tokenizing
  workers. Parquet and CSV files go through ``datasets.load_dataset``.
- a ``save_to_disk`` directory (``datasets.load_from_disk``),
- a hub dataset id (``datasets.load_dataset(path, name, split, revision)``),
  the same packaged builders as the local Parquet/CSV path.

Reading never judges a record's fields (that is ``records.py``). Every later
complaint names ``file:line`` (JSONL), ``file: record i`` (0-based, other
files) or ``id[split]: record i`` (hub).
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmft.data.sources import Source
from llmft.errors import Problem, UserError, library_problem, offline

if TYPE_CHECKING:
    import datasets

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
LINE_EXTENSIONS = (".jsonl", ".json")
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json")
_BUILDERS = {".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Resolved:
    source: Source
    kind: str  # "files", "saved" or "hub"
    files: tuple[Path, ...] = ()  # kind files: the data files in order; kind saved: the directory

    def identity(self) -> dict[str, Any]:
        """What the cache key needs to notice a change: files with sizes and mtimes (hub: the id)."""
        s = self.source
        ident: dict[str, Any] = {"kind": self.kind, "split": s.split, "fields": dict(sorted(s.fields.items()))}
        if self.kind == "hub":
            ident.update(path=s.path, name=s.name, revision=s.revision)
            return ident
        files = self.files if self.kind == "files" else sorted(p for p in self.files[0].rglob("*") if p.is_file())
        ident["files"] = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        return ident


@dataclass
class Chunk:
    """Raw records of consecutive files of one kind, as one ``datasets.Dataset``."""

    dataset: datasets.Dataset
    lines: bool  # columns (file, pos, json, error) rather than the records' own columns
    locator: Locator


@dataclass(frozen=True)
class Locator:
    """Row index of a chunk -> "file:line" / "file: record i" / "id[split]: record i"."""

    names: tuple[str, ...]  # one per file
    lines: tuple[bool, ...]  # JSONL file: pos is a line number
    starts: tuple[int, ...] = (0,)  # table chunks: first row of each file

    def where(self, row: int, file: int | None = None, pos: int | None = None) -> str:
        if file is None:  # a table chunk: find the file by row
            file = max(i for i, s in enumerate(self.starts) if s <= row)
            pos = row - self.starts[file]
        return f"{self.names[file]}:{pos}" if self.lines[file] else f"{self.names[file]}: record {pos}"


def resolve(source: Source) -> Resolved:
    key, text = source.key, source.path
    path = Path(text).expanduser()
    if any(c in text for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        files = [p for p in found if p.suffix in EXTENSIONS]
        if not files:
            raise UserError(Problem(key, f"the pattern '{text}' matches no {_ext_list()} files", "Check the pattern."))
        return Resolved(source, "files", tuple(files))
    if path.is_dir():
        if all((path / marker).is_file() for marker in _SAVE_TO_DISK_MARKERS) or (path / "dataset_dict.json").is_file():
            return Resolved(source, "saved", (path,))
        files = _data_files(path)
        if not files:
            raise UserError(Problem(key, f"directory '{path}' holds no {_ext_list()} files", "Check the path."))
        return Resolved(source, "files", tuple(files))
    if path.is_file():
        if path.suffix not in EXTENSIONS:
            raise UserError(
                Problem(key, f"'{path}' is not a {_ext_list()} file", "Convert it, or rename it if it is one.")
            )
        return Resolved(source, "files", (path,))
    if _looks_like_hub_id(text):
        return Resolved(source, "hub")
    raise UserError(Problem(key, f"path '{path}' does not exist", f"Check the path (relative to {Path.cwd()})."))


def read(resolved: Resolved, work_dir: Path) -> tuple[list[Chunk], str | None]:
    """The chunks of a resolved source, and the hub dataset's fingerprint (None for local data).

    ``work_dir`` receives datasets' own Arrow copies of local Parquet/CSV files and the lines of
    JSON/JSONL files (an Arrow file per group, memory-mapped); the caller removes it.
    """
    if resolved.kind == "hub":
        ds = load_hub(resolved.source)
        split = resolved.source.split or "train"
        return [Chunk(ds, False, Locator((f"{resolved.source.path}[{split}]",), (False,)))], ds._fingerprint
    if resolved.kind == "saved":
        ds = load_saved(resolved.files[0], resolved.source)
        return [Chunk(ds, False, Locator((str(resolved.files[0]),), (False,)))], None
    chunks: list[Chunk] = []
    group: list[Path] = []
    for file in [*resolved.files, None]:
        if group and (file is None or _group_of(file) != _group_of(group[0])):
            lines = _group_of(group[0]) == "lines"
            chunks.append(_read_lines(group, work_dir, len(chunks)) if lines else _read_tables(group, work_dir))
            group = []
        if file is not None:
            group.append(file)
    return chunks, None


def _ext_list() -> str:
    return ", ".join(EXTENSIONS[:-1]) + " or " + EXTENSIONS[-1]


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return (
        not text.startswith((".", "/", "~"))
        and len(parts) <= 2
        and all(p and all(c.isalnum() or c in "-_." for c in p) for p in parts)
        and Path(text).suffix not in EXTENSIONS
    )


def _group_of(file: Path) -> str:
    return "lines" if file.suffix in LINE_EXTENSIONS else file.suffix


def _data_files(directory: Path) -> list[Path]:
    """Data files under ``directory`` (recursively), sorted by relative path; hidden entries skipped."""
    found = []
    for file in directory.rglob("*"):
        rel = file.relative_to(directory)
        if file.is_file() and file.suffix in EXTENSIONS and not any(p.startswith(".") for p in rel.parts):
            found.append(rel)
    return [directory / rel for rel in sorted(found, key=lambda r: r.as_posix())]


# --- JSON and JSONL: records split by llmft, parsed later in the workers -------------


def _read_lines(files: list[Path], work_dir: Path, k: int) -> Chunk:
    """The records' lines as a dataset memory-mapped from an Arrow file in ``work_dir``: tokenizing
    workers then map their shards from that file instead of receiving them pickled."""
    import datasets  # heavy: imported only where records are read (a cache build, a stream)
    import pyarrow as pa

    features = datasets.Features(
        file=datasets.Value("int32"), pos=datasets.Value("int64"), json=datasets.Value("large_string"),
        error=datasets.Value("string"),
    )  # fmt: skip
    schema = features.arrow_schema
    tables = []
    for i, path in enumerate(files):
        table = _jsonl_table(path, i, schema) if path.suffix == ".jsonl" else None
        if table is None:  # a .json file, or a line that is not UTF-8: record by record, to say which
            rows = list(_jsonl_rows(path) if path.suffix == ".jsonl" else json_rows(path))
            cols = {"file": [i] * len(rows), "pos": [r[0] for r in rows], "json": [r[1] for r in rows]}
            table = pa.table({**cols, "error": [r[2] for r in rows]}, schema=schema)
        tables.append(table)
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / f"lines-{k}.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    del table, tables
    ds = datasets.Dataset.from_file(str(path), info=datasets.DatasetInfo(features=features))
    return Chunk(ds, True, Locator(tuple(map(str, files)), tuple(p.suffix == ".jsonl" for p in files)))


def _jsonl_table(path: Path, i: int, schema):
    """A JSONL file's non-blank lines as Arrow columns, split and checked without a Python loop over
    lines (4x faster than ``_jsonl_rows``); None if a line is not UTF-8."""
    import pyarrow as pa  # heavy: only a cache build reads JSONL this way
    import pyarrow.compute as pc

    data = path.read_bytes()
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n")) + 1
    if len(data) and (len(ends) == 0 or ends[-1] != len(data)):
        ends = np.append(ends, len(data))  # a last line without a newline
    offsets = pa.py_buffer(np.concatenate([[0], ends]).astype(np.int64))
    lines = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(ends), [None, offsets, pa.py_buffer(data)])
    try:
        text = lines.cast(pa.large_string())  # validates UTF-8
    except pa.ArrowInvalid:
        return None
    # Blank lines are no records (as ``_jsonl_rows``: str.strip()); only a line that starts with a
    # space, a control character or a non-ASCII byte can be blank, so only those are looked at.
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    first = np.frombuffer(data, dtype=np.uint8)[starts] if len(data) else np.zeros(0, np.uint8)
    maybe = np.flatnonzero((first <= 32) | (first >= 128))
    blank = [k for k in maybe.tolist() if not data[starts[k] : ends[k]].decode("utf-8").strip()]
    pos = np.arange(1, len(ends) + 1, dtype=np.int64)
    if blank:
        keep = np.ones(len(ends), dtype=bool)
        keep[blank] = False
        text, pos = pc.filter(text, pa.array(keep)), pos[keep]
    n = len(pos)
    columns = {"file": np.full(n, i, dtype=np.int32), "pos": pos, "json": text, "error": pa.nulls(n, pa.string())}
    return pa.table(columns, schema=schema)


def _jsonl_rows(path: Path):
    # Bytes, decoded per line: one line of bad UTF-8 is one bad record, not a dead file.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
                continue
            if line.strip():
                yield lineno, line, None


def json_rows(path: Path):
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
        yield i, json.dumps(value), None


def parse_line(text: str | None, error: str | None) -> Any:
    """The JSON value of one raw line; raises ``ValueError`` with the reason."""
    if error is not None:
        raise ValueError(error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None


# --- Parquet, CSV, save_to_disk, hub: datasets ------------------------------------------


def _read_tables(files: list[Path], work_dir: Path) -> Chunk:
    import datasets  # heavy: imported only where records are read (a cache build, a stream)

    parts, starts, row = [], [], 0
    for path in files:
        try:
            ds = datasets.load_dataset(
                _BUILDERS[path.suffix], data_files=[str(path)], split="train", cache_dir=str(work_dir / "hf")
            )
        except Exception as e:  # pyarrow / datasets raise many types for a malformed file
            raise UserError(
                Problem(str(path), f"not a readable {path.suffix[1:]} file ({_reason(e)})", "Check the file.")
            ) from e
        parts.append(ds)
        starts.append(row)
        row += len(ds)
    try:
        ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    except ValueError as e:
        raise UserError(
            Problem(str(files[0].parent), f"its {files[0].suffix} files have different columns ({_reason(e)})",
                    "Give files of different shapes as separate sources in a list.")
        ) from e  # fmt: skip
    return Chunk(ds, False, Locator(tuple(map(str, files)), (False,) * len(files), tuple(starts)))


def load_saved(path: Path, source: Source) -> datasets.Dataset:
    import datasets  # heavy: imported only where records are read (a cache build, a stream)

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        if source.split is None or source.split not in splits:
            raise UserError(_dataset_dict_problem(path, source, splits))
        path = path / source.split
    return datasets.load_from_disk(str(path))


DATASETS_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # what keeps `datasets` off the Hub


def load_hub(source: Source, streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    import datasets  # heavy: imported only where records are read (a cache build, a stream)

    split = source.split or "train"
    try:
        return datasets.load_dataset(
            source.path, name=source.name, split=split, revision=source.revision, streaming=streaming
        )
    except Exception as e:  # offline, unknown id, unknown split or config, gated repo, ...
        when = " (offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)" if offline(DATASETS_OFFLINE) else ""
        raise UserError(
            library_problem(
                source.key,
                f"'{source.path}' is not a local path, and no hub dataset of that name could be loaded{when}",
                e,
                name=source.path,
                dataset=True,
                fix="Check the path (relative to the working directory) or the hub id, name and split; a hub "
                "dataset must be in the local Hugging Face cache when running offline.",
            )
        ) from e


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _dataset_dict_problem(path: Path, source: Source, splits: list[str]) -> Problem:
    key = source.key
    if source.split is not None:
        return Problem(f"{key}.split", f"'{source.split}' is not a split of '{path}' ({', '.join(splits)})", "")
    return Problem(
        key,
        f"'{path}' is a saved DatasetDict with splits {splits}",
        f"Point {key} at one split's directory, e.g. {path / splits[0]}, or give {{path, split}}."
        if splits
        else "Save a Dataset instead.",
    )
