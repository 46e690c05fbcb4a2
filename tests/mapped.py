"""Where a tensor's memory is: a mapping of a weight file (the frozen shards a CPU run reads in
place, llmft/model/meta.py), for the sharded-load probes and the unit tests alike."""

from __future__ import annotations

from pathlib import Path


def in_weight_file(address: int, path: Path | None = None) -> bool:
    """Whether ``address`` lies in a mapping of ``path``, or of any .safetensors file (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[-1] == str(path) if path is not None else rest[-1].endswith(".safetensors")
    return False
