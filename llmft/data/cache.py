"""The tokenized-data cache: one directory per (source, settings), built once, memory-mapped by every rank.

An entry is ``<data.cache_dir>/<key>/`` where ``key`` hashes everything that
changes its contents: the source's files with their sizes and mtimes (or the
hub dataset's fingerprint), the tokenizer (its vocabulary, merges, special
tokens and normaliser, hashed from its serialised form), the chat template,
``max_seq_len``, ``packing``, ``train_on``, ``on_bad_record``, the eval holdout
(fraction and seed), the llmft version and the cache format. A cache built by
another version of llmft or with other settings therefore has another key and
is never reused; ``meta.json`` keeps the parts in readable form, so a miss can
say which setting differs from an entry built for the same data.

Several processes (the ranks of a job, on one node or on a shared disk) may
ask for the same entry at once. Each takes an exclusive ``flock`` on
``<key>.lock`` beside the entry; the first builds into ``<key>.build/entry``
and renames it into place (``meta.json`` is written last, and a rename is
atomic), the others then find it complete and only open it. No barrier is
needed. ``<key>.build/shards`` holds the tokenized shards (``shards.py``): a
build stopped on request keeps them there and the next build of the key reuses
them; a build that fails otherwise, or finishes, removes ``<key>.build``. A
builder killed outright leaves it to the next builder of that key, and a
stopped build no one resumes is removed after ``ORPHAN_DAYS`` by any build in
the same cache dir.

Every process checks an entry before it uses it (``check_entry``): ``meta.json``
carries a crc32 of each ``CHECKSUM_BLOCK`` of every file the build wrote, and a
checksum of itself. An entry that does not match (a flipped bit, a truncated or
missing file, a symlink in place of a file, a half-written ``meta.json``) is
logged, removed and built again: it is never trained on. Reading the whole
entry costs ~0.1 s per 60M tokens here (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmft import stop
from llmft.errors import Problem, UserError
from llmft.stop import Stopped

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("llmft.data")

CACHE_FORMAT = 4  # 2: a layout file beside each Arrow file; 3: checksums in meta.json; 4: eval prompts as arrays
CHECKSUM_BLOCK = 1 << 24  # bytes per crc32: a damaged block is named, and a block is read at a time
BUILD_SUFFIX = ".build"
ORPHAN_DAYS = 7
CACHE_ENV = "LLMFT_CACHE"
META = "meta.json"


def default_cache_dir() -> Path:
    """``$LLMFT_CACHE/data``, else ``$XDG_CACHE_HOME/llmft/data``, else ``~/.cache/llmft/data``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser() / "data"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "llmft" / "data"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of everything in the tokenizer that changes token ids (not its name or path)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary is what we can see
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {
        "class": type(tokenizer).__name__,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "added": sorted((str(k), v) for k, v in tokenizer.get_added_vocab().items()),
        "add_bos": getattr(tokenizer, "add_bos_token", None),
        "add_eos": getattr(tokenizer, "add_eos_token", None),
    }
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


KEY_RE = re.compile(r"[0-9a-f]{24}")  # what entry_key makes


def entry_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def is_complete(entry: Path) -> bool:
    return (entry / META).is_file()


class Damaged(Exception):
    """A cache entry whose files are not the ones its build wrote (``check_entry``); the message says why."""


def read_meta(entry: Path) -> dict[str, Any]:
    """The entry's ``meta.json``, checked against its own checksum; ``Damaged`` if it is not whole."""
    try:
        meta = json.loads((entry / META).read_text())
    except (OSError, ValueError) as e:  # truncated, garbage, not UTF-8, unreadable
        raise Damaged(f"{entry / META}: cannot be read ({e})") from e
    if not isinstance(meta, dict) or meta.get("checksum") != _meta_checksum(meta):
        raise Damaged(f"{entry / META}: does not match its checksum")
    return meta


def _meta_checksum(meta: dict[str, Any]) -> int:
    rest = {k: v for k, v in meta.items() if k != "checksum"}
    return zlib.crc32(json.dumps(rest, sort_keys=True, default=str).encode())


def file_checksums(entry: Path) -> dict[str, dict[str, Any]]:
    """Each file of a just-built entry: its size and the crc32 of each ``CHECKSUM_BLOCK`` bytes."""
    return {p.name: {"bytes": p.stat().st_size, "crc32": _block_crcs(p)} for p in sorted(entry.iterdir())}


def _block_crcs(path: Path) -> list[int]:
    # O_NOFOLLOW | O_NONBLOCK: a symlink or a FIFO put in place of a file fails here, never hangs.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        crcs, buf = [], bytearray(CHECKSUM_BLOCK)
        while n := f.readinto(buf):
            crcs.append(zlib.crc32(memoryview(buf)[:n]))
        return crcs


def check_entry(entry: Path) -> dict[str, Any]:
    """The meta of a complete entry whose every file matches the checksums written at build time.

    Reads every byte once (crc32, ~2 GB/s: docs/benchmarks.md), through ``read`` rather than the
    memory map, so the check leaves the process's RSS alone. ``Damaged`` says what differs."""
    if entry.is_symlink():
        raise Damaged(f"{entry}: is a symbolic link, not an entry llmft built")
    meta = read_meta(entry)
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise Damaged(f"{entry / META}: lists no checksums")
    for name, want in files.items():
        path = entry / name
        try:
            size, crcs = path.lstat().st_size, _block_crcs(path)
        except OSError as e:
            raise Damaged(f"{path}: cannot be read ({e.strerror or e})") from e
        if not isinstance(want, dict) or size != want.get("bytes") or crcs != want.get("crc32"):
            raise Damaged(f"{path}: does not match the checksum written when the entry was built")
    return meta


def write_meta(entry: Path, meta: dict[str, Any]) -> None:
    meta = {**meta, "files": file_checksums(entry)}
    meta["checksum"] = _meta_checksum(meta)
    (entry / META).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))


def get_or_build(root: Path, parts: dict[str, Any], build: Callable[[Path, Path], dict[str, Any]]) -> tuple[Path, bool]:
    """The verified entry for ``parts``, built unless a whole one exists; (entry, built).

    ``build(out, shards) -> meta`` writes the entry's files into ``out``; ``shards`` is the folder
    where it keeps finished tokenized shards, which outlives a stopped build (``llmft.stop``) so the
    next build of this key reuses them. A damaged entry (``check_entry``) is removed and built again.
    """
    key = entry_key(parts)
    entry = root / key
    if _whole(entry):
        return entry, False
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f"{key}.lock", entry):
            if _whole(entry, warn=True):
                return entry, False
            _remove(entry)
            _build_locked(root, key, parts, build)
    except OSError as e:
        if e.errno is None and e.filename is None:  # e.g. pyarrow's errors about a file's contents
            raise
        raise cache_write_error(e, root) from e
    return entry, True


def _whole(entry: Path, warn: bool = False) -> bool:
    if not is_complete(entry) and not entry.is_symlink():
        return False
    try:
        check_entry(entry)
        return True
    except Damaged as e:
        if warn:
            log.warning("data cache: %s; building the entry again", e)
        return False


def _build_locked(root: Path, key: str, parts: dict[str, Any], build: Callable[[Path, Path], dict[str, Any]]) -> None:
    """Build ``key`` into ``<key>.build/`` and rename it into place; we hold the key's lock."""
    for stale in root.glob(f"{key}.tmp-*"):  # temp dirs of llmft before 0.x's resumable builds
        _remove(stale)
    _remove_orphans(root, key)
    work = root / f"{key}{BUILD_SUFFIX}"
    out, shards = work / "entry", work / "shards"
    _remove(out)  # a stopped build's half-written entry: only its shards are worth keeping
    shards.mkdir(parents=True, exist_ok=True)
    out.mkdir()
    explain_miss(root, parts)
    started, stopped = time.time(), False
    try:
        meta = build(out, shards)
        meta.update(parts=parts, key=key, built_at=time.strftime("%Y-%m-%d %H:%M:%S"))
        meta["build_seconds"] = round(time.time() - started, 2)
        write_meta(out, meta)  # last: an entry without a whole meta.json is not an entry
        os.rename(out, root / key)
    except (Stopped, KeyboardInterrupt):  # a second Ctrl-C too: the shards are as good
        stopped = True
        raise
    finally:
        # Stopped: keep the finished shards for the next build of this key (a requeued job);
        # anything else (done, bad data, a full disk): nothing here is worth keeping.
        _remove(out if stopped else work)


def _remove(path: Path) -> None:
    """Remove a file, a symlink (not what it points to) or a folder, if there."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _remove_orphans(root: Path, key: str) -> None:
    """Build folders of other keys that a stop left and no build took up for ``ORPHAN_DAYS`` days."""
    cutoff = time.time() - ORPHAN_DAYS * 86400
    for work in root.glob(f"*{BUILD_SUFFIX}"):
        other = work.name[: -len(BUILD_SUFFIX)]
        # Only the cache's own names (an entry key: 24 hex digits) and real folders: a folder of the
        # user's in data.cache_dir that happens to end in .build is never removed.
        if not KEY_RE.fullmatch(other) or work.is_symlink() or not work.is_dir():
            continue
        if other == key or work.stat().st_mtime > cutoff:
            continue
        with open(root / f"{other}.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            log.info("data cache: removing %s, a stopped build not resumed for %d days", work, ORPHAN_DAYS)
            shutil.rmtree(work, ignore_errors=True)


def cache_write_error(e: OSError, root: Path) -> UserError:
    """An OSError met while building in ``root`` as a message: the path, what failed, and the fix."""
    path = e.filename or root
    what = f"cannot write '{path}' ({e.strerror or e})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            what += f"; {shutil.disk_usage(root).free / 2**30:.1f} GiB free there"
        except OSError:
            pass
        fix = f"Free space there, or set data.cache_dir=<a folder with room> (now '{root}')."
    else:
        fix = f"Set data.cache_dir=<a folder you can write> (now '{root}'), or fix its permissions."
    if not str(path).startswith(str(root)):  # a source file, not the cache
        fix = "Check that it exists and that this user can read it."
        return UserError(Problem(str(path), f"cannot be read ({e.strerror or e})", fix))
    return UserError(Problem("data.cache_dir", what, fix))


# How long a process waits for another to build the same entry: a long tokenization, but not forever
# (a builder stopped with SIGSTOP, or a lock that a network filesystem never releases).
BUILD_WAIT_S = 6 * 3600
WAIT_LOG_S = 300  # how often the wait is logged, with how long it has lasted


@contextlib.contextmanager
def _locked(lock: Path, entry: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """An exclusive flock on ``lock``; while another process holds it, wait (polled, so that a stop
    request ends the wait), logging every ``WAIT_LOG_S`` and giving up after ``wait_s``."""
    with open(lock, "a") as f:
        started = time.monotonic()
        last_log = None
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                stop.check()
                waited = time.monotonic() - started
                if waited >= wait_s:
                    raise UserError(
                        Problem(
                            "data.cache_dir",
                            f"waited {waited / 60:.0f} min for another process to build {entry} (it holds {lock})",
                            "Check that process (`fuser` on the lock file names it); remove the lock file if none "
                            "holds it, or point data.cache_dir at another directory.",
                        )
                    ) from None
                if last_log is None or time.monotonic() - last_log >= WAIT_LOG_S:
                    log.info("data cache: waiting (%.0f s so far) for another process to build %s", waited, entry)
                    last_log = time.monotonic()
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def explain_miss(root: Path, parts: dict[str, Any]) -> str | None:
    """Log (and return) why no entry fits, naming the settings where the closest entry for this data differs."""
    ours = parts["source"]
    best: tuple[int, Path, list[str]] | None = None
    for meta_path in root.glob(f"*/{META}"):
        if not meta_path.is_file():  # a FIFO or a device would block or never end
            continue
        try:
            theirs = json.loads(meta_path.read_text())["parts"]
        except (OSError, ValueError, KeyError, TypeError):  # a damaged entry says nothing about settings
            continue
        if not isinstance(theirs, dict):
            continue
        same_data = _source_names(theirs.get("source")) == _source_names(ours)
        if not same_data:
            continue
        diffs = [
            f"{k}: {_short(theirs.get(k))} -> {_short(parts.get(k))}"
            for k in sorted(set(parts) | set(theirs))
            if theirs.get(k) != parts.get(k)
        ]
        if best is None or len(diffs) < best[0]:
            best = (len(diffs), meta_path.parent, diffs)
    if best is None:
        return None
    why = f"data cache: {best[1]} holds this data with other settings ({'; '.join(best[2])}); building a new entry"
    log.info("%s", why)
    return why


def _source_names(source: Any) -> Any:
    if not isinstance(source, dict):
        return source
    return {k: ([f[0] for f in v] if k == "files" else v) for k, v in source.items()}


def _short(value: Any) -> str:
    if isinstance(value, dict) and "files" in value:
        return "files changed (size or mtime)"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def size_of(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
