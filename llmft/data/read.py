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

Bounds (``llmft.limits``): a JSONL line or a .json file's record of more than
``RECORD_MAX_BYTES``, or nested more than ``RECORD_MAX_DEPTH`` levels, is one
bad record (``data.on_bad_record``), never parsed whole or recursed into; a
.json file larger than ``JSON_FILE_MAX_BYTES`` is refused (it is parsed whole).
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmft import stop
from llmft.data.sources import Source
from llmft.errors import Problem, UserError, library_problem, offline
from llmft.limits import JSON_FILE_MAX_BYTES, RECORD_MAX_BYTES, RECORD_MAX_DEPTH, nests_deeper

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
        stop.check()  # between files: a stop during a build that reads many files ends it here
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
        stop.check()
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
    lines (4x faster than ``_jsonl_rows``); None if a line is not UTF-8 or too long."""
    import pyarrow as pa  # heavy: only a cache build reads JSONL this way
    import pyarrow.compute as pc

    data = path.read_bytes()
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n")) + 1
    if len(data) and (len(ends) == 0 or ends[-1] != len(data)):
        ends = np.append(ends, len(data))  # a last line without a newline
    if len(ends) and int(np.diff(ends, prepend=0).max()) > RECORD_MAX_BYTES:
        return None  # a line too long to be a record: said by ``_jsonl_rows``, line by line
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


STOP_CHECK_LINES = 4096  # lines between two looks at the stop request when a file is read line by line


def _jsonl_rows(path: Path):
    # Bytes, decoded per line: one line of bad UTF-8 is one bad record, not a dead file.
    with open(path, "rb") as f:
        for lineno, raw, size in bounded_lines(f):
            if lineno % STOP_CHECK_LINES == 0:
                stop.check()  # a file read line by line (it holds a bad line): the stop is seen within seconds
            if raw is None:
                yield lineno, None, too_long(size)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, not_utf8(e)
                continue
            if line.strip():
                yield lineno, line, None


def bounded_lines(f, limit: int | None = None):
    """``(line number, bytes, size)`` for each line of the binary file ``f``; bytes None for a line of
    more than ``limit`` bytes (default ``RECORD_MAX_BYTES``), skipped a MiB at a time, never held whole.

    A line is read a MiB at a time (a short line in one call), so a line past the limit costs at most
    the limit and a MiB: one ``readline(limit + 1)`` would join its chunks into a second copy. After
    each line ``f.tell()`` is where the next one starts (the stream's byte cursor)."""
    limit = RECORD_MAX_BYTES if limit is None else limit
    step = min(limit + 1, 1 << 20)
    lineno = 0
    while raw := f.readline(step):
        lineno += 1
        parts, size = [raw], len(raw)
        while not raw.endswith(b"\n") and size <= limit:  # more of the line, while it may be a record
            if not (raw := f.readline(step)):
                break  # the last line, without a newline
            parts.append(raw)
            size += len(raw)
        if size - raw.endswith(b"\n") <= limit:
            yield lineno, parts[0] if len(parts) == 1 else b"".join(parts), size
            continue
        parts.clear()
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            size += len(raw)
        yield lineno, None, size - raw.endswith(b"\n")  # the line's bytes, without its newline


def not_utf8(e: UnicodeDecodeError) -> str:
    """Why a line is not text, as every reader of data says it (``e.start``: the byte in the line)."""
    return f"not valid UTF-8 ({e.reason} at byte {e.start})"


def too_long(size: int, unit: str = "bytes", fix: str = "split it into several records") -> str:
    what = f"is {size} {unit}, more than the {size_text(RECORD_MAX_BYTES)} one record may be (llmft.limits.RECORD_MAX_BYTES)"
    return f"{what}; {fix}" if fix else what


def size_text(n: int) -> str:
    """A limit in bytes as a person reads it: ``4 GiB``, ``64 MiB`` or ``1000 bytes``."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def too_deep(value: Any) -> bool:
    """Whether a record nests objects and lists more than ``RECORD_MAX_DEPTH`` levels."""
    return nests_deeper(value, RECORD_MAX_DEPTH)


# JSON may escape half of a UTF-16 pair alone (``"\ud800"``): json.loads makes it a lone surrogate,
# which no tokenizer takes (a TypeError deep in the Rust tokenizer). UTF-8 bytes cannot hold one, so
# only a line with such an escape is searched.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = (
    "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), which is no character; "
    "fix or drop that escape"
)


def lone_surrogate(value: Any) -> bool:
    """Whether a string of JSON ``value`` (or a key) holds a lone surrogate (a loop, not recursion)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


DEEP = f"nests objects and lists more than {RECORD_MAX_DEPTH} levels deep (llmft.limits.RECORD_MAX_DEPTH)"
TOO_DEEP = f"{DEEP}; a record nests a few (messages[].content), flatten it"


def json_rows(path: Path):
    try:
        size = path.stat().st_size
        if size > JSON_FILE_MAX_BYTES:
            raise UserError(
                Problem(
                    str(path),
                    f"is {size} bytes, more than the {size_text(JSON_FILE_MAX_BYTES)} a .json data file may be "
                    "(it is parsed whole)",
                    "Write one record per line to a .jsonl file (read line by line), e.g. "
                    f"`jq -c '.[]' {path.name} > {path.stem}.jsonl`.",
                )
            )
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        hint = "; a file with one record per line should be named .jsonl" if e.msg == "Extra data" else ""
        raise UserError(
            Problem(f"{path}:{e.lineno}", f"not valid JSON ({e.msg} at column {e.colno}){hint}", "Fix the file.")
        ) from e
    except UnicodeDecodeError as e:
        raise UserError(Problem(str(path), f"not valid UTF-8 ({e.reason} at byte {e.start})", "Fix the file.")) from e
    except RecursionError:
        fix = "A record nests a few levels (messages[].content): flatten the file's records."
        raise UserError(Problem(str(path), DEEP, fix)) from None
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
        if too_deep(value):
            yield i, None, TOO_DEEP
            continue
        text = json.dumps(value)
        yield (i, text, None) if len(text) <= RECORD_MAX_BYTES else (i, None, too_long(len(text)))


def parse_line(text: str | None, error: str | None) -> Any:
    """The JSON value of one raw line; raises ``ValueError`` with the reason (a line longer or nested
    deeper than a record may be is one: ``llmft.limits``)."""
    if error is not None:
        raise ValueError(error)
    if len(text) > RECORD_MAX_BYTES:  # characters: at least as many bytes (readers check bytes)
        raise ValueError(too_long(len(text), "characters"))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # json's C scanner, past ~1000 levels: unwound cleanly
        raise ValueError(TOO_DEEP) from None
    if too_deep(value):
        raise ValueError(TOO_DEEP)
    if _SURROGATE_ESCAPE.search(text) and lone_surrogate(value):
        raise ValueError(LONE_SURROGATE)
    return value


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
