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
``<key>.lock`` beside the entry; the first builds into ``<key>.tmp-<host>-<pid>``
and renames it into place (``meta.json`` is written last, and a rename is
atomic), the others then find it complete and only open it. No barrier is
needed, and a builder that dies leaves at most a temp directory that the next
builder of that key removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("llmft.data")

CACHE_FORMAT = 2  # 2: a layout file beside each Arrow file
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


def entry_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def is_complete(entry: Path) -> bool:
    return (entry / META).is_file()


def read_meta(entry: Path) -> dict[str, Any]:
    return json.loads((entry / META).read_text())


def get_or_build(root: Path, parts: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> tuple[Path, bool]:
    """The complete entry for ``parts``, built by ``build(tmp_dir) -> meta`` unless it exists; (entry, built)."""
    key = entry_key(parts)
    entry = root / key
    if is_complete(entry):
        return entry, False
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from llmft.errors import Problem, UserError

        raise UserError(
            Problem("data.cache_dir", f"cannot create '{root}' ({e.strerror})", "Set data.cache_dir to a writable dir.")
        ) from e
    with _locked(root / f"{key}.lock", entry):
        if is_complete(entry):
            return entry, False
        for stale in root.glob(f"{key}.tmp-*"):  # we hold the lock: nobody else is building this key
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():  # not complete, yet renamed into place: cannot happen unless edited by hand
            shutil.rmtree(entry)
        explain_miss(root, parts)
        tmp = root / f"{key}.tmp-{socket.gethostname()}-{os.getpid()}"
        tmp.mkdir()
        try:
            started = time.time()
            meta = build(tmp)
            meta.update(parts=parts, key=key, built_at=time.strftime("%Y-%m-%d %H:%M:%S"))
            meta["build_seconds"] = round(time.time() - started, 2)
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
            os.rename(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, True


# How long a process waits for another to build the same entry: a long tokenization, but not forever
# (a builder stopped with SIGSTOP, or a lock that a network filesystem never releases).
BUILD_WAIT_S = 6 * 3600
WAIT_LOG_S = 300  # how often the wait is logged, with how long it has lasted


@contextlib.contextmanager
def _locked(lock: Path, entry: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    with open(lock, "a") as f:
        started = time.monotonic()
        last_log = None
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= wait_s:
                    from llmft.errors import Problem, UserError

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
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def explain_miss(root: Path, parts: dict[str, Any]) -> str | None:
    """Log (and return) why no entry fits, naming the settings where the closest entry for this data differs."""
    ours = parts["source"]
    best: tuple[int, Path, list[str]] | None = None
    for meta_path in root.glob(f"*/{META}"):
        try:
            theirs = json.loads(meta_path.read_text())["parts"]
        except (OSError, ValueError, KeyError):
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
