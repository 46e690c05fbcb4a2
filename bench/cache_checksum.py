"""What checking a cache entry costs (docs/benchmarks.md): crc32 per 16 MiB block of every file.

Writes an entry of ``--tokens`` tokens (unpacked rows of 512, the Arrow file and its layout, as a
build writes them), then times: checksumming it at build time (``cache.file_checksums``), verifying
it on open (``cache.verify``, what every process does before it maps an entry), once with the
file in the page cache (the usual case: the build or another rank just read it) and once after
dropping it from the page cache where that is allowed (``posix_fadvise DONTNEED``), and mapping it
(``TokenDataset.open``) for comparison.

    python bench/cache_checksum.py                  # 60M tokens (~300 MB)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from llmft.data.cache import file_checksums, verify, write_meta
from llmft.data.tokens import TokenDataset


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def drop_page_cache(entry: Path) -> None:
    for p in entry.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=60_000_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmft-checksum-", dir=os.environ.get("TMPDIR")) as tmp:
        entry = Path(tmp) / "entry"
        entry.mkdir()
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 32000, args.tokens, dtype=np.int32)
        target = (rng.random(args.tokens) < 0.7).astype(np.uint8)
        offsets = np.arange(0, args.tokens + 1, 512, dtype=np.int64)
        offsets[-1] = args.tokens
        TokenDataset.from_arrays(ids, target, offsets).write(entry / "rows.arrow")
        del ids, target
        size = sum(f.stat().st_size for f in entry.iterdir())
        t_sum, _ = timed(lambda: file_checksums(entry))
        write_meta(entry, {"stats": {}})
        t_warm, _ = timed(lambda: verify(entry))
        drop_page_cache(entry)
        t_cold, _ = timed(lambda: verify(entry))
        t_open, _ = timed(lambda: TokenDataset.open(entry / "rows.arrow"))
        gb = size / 1e9
        print(f"entry of {args.tokens:,} tokens: {size / 2**20:,.0f} MiB")
        print("| step | seconds | GB/s |")
        print("| --- | --- | --- |")
        for name, t in [
            ("checksums at build time (file_checksums)", t_sum),
            ("verify on open, file in the page cache", t_warm),
            ("verify on open, page cache dropped first", t_cold),
            ("TokenDataset.open (map, no read)", t_open),
        ]:
            print(f"| {name} | {t:.3f} | {gb / t:.2f} |")


if __name__ == "__main__":
    main()
