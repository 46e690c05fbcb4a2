"""Tokenizing a source's records in shards, in worker processes, resumable after a stop.

Each chunk's records are cut into shards of consecutive records (how many depends on the number
of records alone, not on ``data.num_proc``, so a requeued build with another ``num_proc`` finds the
same shards). A shard is tokenized by ``rows.Tokenize`` and written as one Arrow file,
``chunk<i>-<lo>-<hi>.arrow``, into the entry's shard folder (``cache.get_or_build`` keeps that
folder, under ``<key>.build/``, when a build is stopped): under a ``.part`` name until it is whole,
so a shard file with its final name is a finished one, and the next build of the same key takes it
as it is (``reusing N of M tokenized shards`` in the log).

With ``data.num_proc`` > 1 each shard is tokenized in a forked worker process. Workers ignore the
stop signals (a scheduler signals the whole process group; the builder alone decides, and one stop
is one log line); the builder polls ``llmft.stop`` while they work, and on a stop kills them
(SIGKILL: their unfinished ``.part`` files are removed by the next build) and raises ``Stopped``
within a fraction of a second.

In one process (``data.num_proc`` 1, or data small enough for one shard) the builder checks
``llmft.stop`` before each call of the tokenizer. A call takes up to ``BATCH`` records, but no more
than about ``CALL_S`` seconds of them: the first call of a shard takes one record, and each next
one as many as the last call's pace fits in ``CALL_S`` (at most twice as many). Fast records still
go ``BATCH`` at a time after a few calls; a slow chat template (a second a record) is called one
record at a time, so a stop waits for one record, not for 256. The rows do not depend on where the
calls are cut (each record is encoded on its own).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmft import stop
from llmft.data.read import Chunk
from llmft.data.workers import ignore_stop_signals, stop_signals_blocked

if TYPE_CHECKING:
    from llmft.data.rows import Tokenize

log = logging.getLogger("llmft.data")

SHARD_MIN_RECORDS = 4096  # below this, a worker process costs more than it saves
MAX_SHARDS = 256  # per chunk: a stop loses at most ~1/256 of the work per worker
BATCH = 256  # most records per tokenizer call
CALL_S = 0.5  # a tokenizer call takes about this long at most (in one process: how long a stop may wait)
Job = tuple[int, int, int]  # (chunk index, first record, end record)


def shard_ranges(n: int) -> list[tuple[int, int]]:
    """Consecutive record ranges covering ``range(n)``; a function of ``n`` alone."""
    size = max(SHARD_MIN_RECORDS, -(-n // MAX_SHARDS))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def shard_path(folder: Path, job: Job) -> Path:
    return folder / f"chunk{job[0]}-{job[1]}-{job[2]}.arrow"


def tokenize_shards(chunks: list[Chunk], tokenizers: list[Tokenize], folder: Path, procs: int, what: str) -> list:
    """Every chunk's records tokenized, as one ``pyarrow.Table`` per shard (memory-mapped), in record order."""
    jobs = [(i, lo, hi) for i, c in enumerate(chunks) for lo, hi in shard_ranges(len(c.dataset))]
    for p in folder.iterdir():  # what a killed worker or an older shard layout left
        if p.suffix != ".arrow" or p.name not in {shard_path(folder, j).name for j in jobs}:
            p.unlink()
    tables = {j: _load(shard_path(folder, j), j) for j in jobs}
    todo = [j for j in jobs if tables[j] is None]
    if len(todo) < len(jobs):
        log.info("%s: reusing %d of %d tokenized shards of a stopped build", what, len(jobs) - len(todo), len(jobs))
    procs = max(1, min(procs, len(todo)))
    if todo:
        log.info("%s: tokenizing %d shard(s) with %d process(es)", what, len(todo), procs)
    run = _run_here if procs == 1 else _run_forked
    run(todo, chunks, tokenizers, folder, procs)
    stop.check()  # a stop during the last shard: they are all kept, the next build only assembles
    for j in todo:
        tables[j] = _load(shard_path(folder, j), j)
        assert tables[j] is not None, f"shard {j} was written but cannot be read"
    return [tables[j] for j in jobs]


def _load(path: Path, job: Job):
    """A finished shard, memory-mapped, or None when there is none (or only a damaged one)."""
    import pyarrow as pa  # only the building process

    if not path.exists():
        return None
    try:
        table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        if table.num_rows == job[2] - job[1]:
            return table
    except (OSError, pa.ArrowInvalid):
        pass
    path.unlink()
    return None


def _run_here(todo: list[Job], chunks: list[Chunk], tokenizers: list[Tokenize], folder: Path, procs: int) -> None:
    for job in todo:
        _write_shard(chunks[job[0]], tokenizers[job[0]], job, shard_path(folder, job), stop.check)


def _run_forked(todo: list[Job], chunks: list[Chunk], tokenizers: list[Tokenize], folder: Path, procs: int) -> None:
    """Up to ``procs`` forked workers at a time, one shard each; a stop request kills them."""
    ctx = multiprocessing.get_context("fork")  # the tokenizer and the records' maps are inherited, not pickled
    pending, running = list(todo), {}
    try:
        while pending or running:
            stop.check()
            while pending and len(running) < procs:
                job = pending.pop(0)
                path = shard_path(folder, job)
                with stop_signals_blocked():  # born with them blocked, the worker ignores them before unblocking
                    p = ctx.Process(target=_worker, args=(chunks[job[0]], tokenizers[job[0]], job, path))
                    p.start()
                running[p.sentinel] = (p, job)
            for sentinel in wait(list(running), timeout=0.2):
                p, job = running.pop(sentinel)
                p.join()
                if p.exitcode != 0:
                    raise _worker_error(p.exitcode, shard_path(folder, job), job)
    finally:
        for p, job in running.values():  # stopped or failed: the others' work is not needed now
            p.kill()
            p.join()
            path = shard_path(folder, job)
            for left in (path.with_name(path.name + ".part"), _error_path(path)):
                left.unlink(missing_ok=True)


def _worker(chunk: Chunk, tokenize: Tokenize, job: Job, path: Path) -> None:
    ignore_stop_signals()
    try:
        _write_shard(chunk, tokenize, job, path, lambda: None)
    except BaseException as e:  # reported through a file: the exit code alone says nothing
        info = {}
        if isinstance(e, OSError):
            info = {
                "errno": e.errno,
                "strerror": e.strerror,
                "filename": None if e.filename is None else str(e.filename),
            }
        _error_path(path).write_text(json.dumps({**info, "traceback": traceback.format_exc()}))
        os._exit(1)


def _error_path(path: Path) -> Path:
    return path.with_name(path.name + ".error")


def _worker_error(exitcode: int, path: Path, job: Job) -> Exception:
    where = f"records {job[1]}..{job[2] - 1} of chunk {job[0]}"
    err = _error_path(path)
    if not err.exists() and exitcode < 0:  # killed: by the kernel's OOM killer, most likely
        return RuntimeError(f"the worker tokenizing {where} was killed by signal {-exitcode}")
    if not err.exists():
        return RuntimeError(f"the worker tokenizing {where} exited with code {exitcode}")
    info = json.loads(err.read_text())
    err.unlink()
    if info.get("errno") is not None:  # e.g. the disk filled: the builder turns it into a message
        return OSError(info["errno"], info["strerror"], info["filename"])
    return RuntimeError(f"the worker tokenizing {where} failed:\n{info['traceback']}")


def _write_shard(chunk: Chunk, tokenize: Tokenize, job: Job, path: Path, check: Callable[[], None]) -> None:
    """Tokenize records ``job[1]:job[2]`` into ``path`` (under a ``.part`` name until whole)."""
    import pyarrow as pa  # only the building process

    columns = [("input_ids", pa.large_list(pa.int32())), ("target", pa.large_list(pa.uint8())), ("error", pa.string())]
    if tokenize.values:  # the objective's record fields: one float64 per field and record
        columns.append(("values", pa.large_list(pa.float64())))
    if tokenize.records:  # prompt records: each record's JSON bytes
        columns.append(("record", pa.large_list(pa.uint8())))
    schema = pa.schema(columns)
    part = path.with_name(path.name + ".part")
    try:
        with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            a, size = job[1], 1
            while a < job[2]:
                check()
                b, started = min(job[2], a + size), time.perf_counter()
                out = tokenize(chunk.dataset[a:b])
                size = next_call_size(b - a, time.perf_counter() - started)
                a = b
                ids, target = _lists(out["input_ids"], np.int32), _lists(out["target"], np.uint8)
                arrays = [ids, target, pa.array(out["error"], pa.string())]
                if tokenize.values:
                    arrays.append(_lists(out["values"], np.float64))
                if tokenize.records:
                    arrays.append(_lists(out["record"], np.uint8))
                writer.write_batch(pa.record_batch(arrays, schema=schema))
        os.rename(part, path)
    finally:
        if part.exists():
            part.unlink()


def next_call_size(records: int, seconds: float) -> int:
    """Records for the next tokenizer call after one of ``records`` took ``seconds``: what fits in
    ``CALL_S`` at that pace, at most twice ``records`` and ``BATCH``, at least one."""
    fits = int(CALL_S * records / seconds) if seconds > 0 else BATCH
    return max(1, min(BATCH, 2 * records, fits))


def _lists(arrays: list[np.ndarray], dtype: type):
    import pyarrow as pa  # only the building process

    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
