"""llmft sets glibc's mmap threshold itself (llmft/malloc.py). By default glibc raises the
threshold to the size of every mapped block that is freed, so after a 16 MiB tensor is freed an
8 MiB one comes from the heap; with the threshold fixed it is a mapping of its own again."""

import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# mallinfo2().hblks: the number of blocks malloc serves from their own mmap.
PROBE = """
import ctypes, json, sys

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
set_here = None
if sys.argv[1] == "cli":
    from llmft import cli
    cli.main(["train", "/nonexistent.yaml"])  # a user error: the allocator is set before it
elif sys.argv[1] == "call":
    from llmft.malloc import use_mmap_for_large_blocks
    set_here = use_mmap_for_large_blocks()
libc.free(ctypes.c_void_p(libc.malloc(16 << 20)))  # a freed "weight": glibc's default raises the threshold
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)
print(json.dumps({"new_mappings": libc.mallinfo2().hblks - before, "set_here": set_here}))
"""


def _probe(mode: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_by_default_a_freed_block_moves_the_threshold():
    assert _probe("none")["new_mappings"] == 0


def test_a_heavy_command_keeps_large_blocks_mapped():
    assert _probe("cli")["new_mappings"] == 1


def test_the_users_own_setting_wins():
    got = _probe("call", MALLOC_MMAP_THRESHOLD_="33554432")  # 32 MiB: the 8 MiB block is heap
    assert got == {"new_mappings": 0, "set_here": False}


def test_mallinfo2_exists():  # the probe's instrument, so that a failure above is about llmft
    assert hasattr(ctypes.CDLL(None), "mallinfo2")
