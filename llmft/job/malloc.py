"""The host allocator behaviour llmft's memory numbers assume, set by llmft itself, phase by phase.

glibc serves a large ``malloc`` from its own ``mmap`` only above a threshold, and that threshold
*grows* to the size of every large block freed (up to 32 MiB on 64-bit). After a model load has
freed a few weight-sized buffers, later tensors of up to that size come from the heap arenas,
and a freed tensor in the middle of an arena stays in the resident set: the peak host RAM of
loading and of a merged export grows by a fifth to a half (measured with bench/load_memory.py
with and without ``MALLOC_MMAP_THRESHOLD_``).

Two phases, two fixed thresholds:

- **Loading and export** (``use_mmap_for_large_blocks``, at the start of ``llmft train`` /
  ``export`` / ``verify``): 64 KiB. Every tensor of any size is its own mapping, returned to the
  kernel when it is freed, so RSS follows the live tensors, as the planner counts them.
- **Training steps** (``settle_for_steps``, once the model is loaded, before the first step;
  the run's planner picks the value: ``llmft.plan.memory.step_mmap_threshold``): on single and
  DDP 32 MiB, glibc's own ceiling, fixed (a fixed value also stops the dynamic growth), and the
  loading's free heap pages trimmed. A step allocates and frees the same tensors every time:
  from the arenas they are reused; as mappings every one of them is a fresh ``mmap`` whose pages
  fault in again (a held-out comparison read 0.54 of a plain loop with 64 KiB kept for the
  steps). FSDP2 and ZeRO-3 gather weights every step: they keep 64 KiB, as a weight released in
  the middle of an arena would stay resident (measured: more host RAM per rank at the peak
  with bench/load_memory.py).

A ``MALLOC_MMAP_THRESHOLD_`` the user set in the environment wins: nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

MMAP_THRESHOLD = 65536  # loading and export
STEP_MMAP_THRESHOLD = 32 << 20  # training steps, at most: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
ENV = "MALLOC_MMAP_THRESHOLD_"

_managed = False  # this process's threshold is llmft's (set by use_mmap_for_large_blocks)


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or ENV in os.environ:
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _set_threshold(threshold: int) -> bool:
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except AttributeError:  # a libc without mallopt: keep its defaults
        return False


def use_mmap_for_large_blocks() -> bool:
    """Fix glibc's mmap threshold at 64 KiB in this process (loading, export); True when it was set
    here.

    Does nothing off glibc Linux (musl, macOS have no such threshold) or when the user set
    ``MALLOC_MMAP_THRESHOLD_`` (glibc read it at process start). Children started later
    (DataLoader workers fork, so they inherit the setting) need nothing more."""
    global _managed
    _managed = _set_threshold(MMAP_THRESHOLD)
    return _managed


def settle_for_steps(threshold: int = STEP_MMAP_THRESHOLD) -> bool:
    """The model is loaded: fix the threshold at ``threshold`` bytes (64 KiB to 32 MiB) for the
    training steps and give the loading's free heap pages back (``malloc_trim``). Only where ``use_mmap_for_large_blocks`` set
    the threshold (a library caller's process, or the user's setting, is left alone); True when
    it did something."""
    threshold = min(max(threshold, MMAP_THRESHOLD), STEP_MMAP_THRESHOLD)
    if not _managed or not _set_threshold(threshold):
        return False
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return True
