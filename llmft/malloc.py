"""The host allocator behaviour llmft's memory numbers assume, set by llmft itself.

glibc serves a large ``malloc`` from its own ``mmap`` only above a threshold, and that threshold
*grows* to the size of every large block freed (up to 32 MiB on 64-bit). After a model load has
freed a few weight-sized buffers, later tensors of up to that size come from the heap arenas,
and a freed tensor in the middle of an arena stays in the resident set: the peak host RAM of
loading and of a merged export grows by a fifth to a half (docs/benchmarks.md). A fixed threshold
of 64 KiB gives every tensor of any size its own mapping, returned to the kernel when the tensor
is freed, so RSS follows the live tensors, as the planner counts them.

This is what ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment does; users do not set it, so
``llmft train`` / ``export`` / ``verify`` set it through ``mallopt`` at start-up. A value the user
did set in the environment wins.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

MMAP_THRESHOLD = 65536
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"


def use_mmap_for_large_blocks() -> bool:
    """Fix glibc's mmap threshold at 64 KiB in this process; True when it was set here.

    Does nothing off glibc Linux (musl, macOS have no such threshold) or when the user set
    ``MALLOC_MMAP_THRESHOLD_`` (glibc read it at process start). Children started later
    (DataLoader workers fork, so they inherit the setting) need nothing more."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or ENV in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # a libc without mallopt: keep its defaults
        return False
