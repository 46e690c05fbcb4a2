"""llmft sets glibc's mmap threshold itself, phase by phase (llmft/job/malloc.py).

By default glibc raises the threshold to the size of every mapped block that is freed, so after a
16 MiB tensor is freed an 8 MiB one comes from the heap. While a model loads (and through an
export) llmft fixes it at 64 KiB: the 8 MiB block is a mapping of its own. For the training steps
it is fixed at 32 MiB: an 8 MiB block comes from the heap, where a step's tensors are reused
without page faults, and so does a 24 MiB one (glibc's own threshold, raised to 16 MiB by the free,
would map it). The threshold in effect is read back
through ``mallinfo2().hblks`` (the blocks malloc serves from their own mmap), never by timing."""

import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest
from helpers import write_recipe

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

PROBE = """
import ctypes, json, sys

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p


def mapped(mib):  # True when a block of `mib` MiB gets a mapping of its own
    before = libc.mallinfo2().hblks
    block = libc.malloc(mib << 20)
    got = libc.mallinfo2().hblks - before
    libc.free(ctypes.c_void_p(block))
    return got == 1


def probe():
    libc.free(ctypes.c_void_p(libc.malloc(16 << 20)))  # a freed "weight": glibc's default raises the threshold
    return {"8": mapped(8), "24": mapped(24)}


got = {}
mode = sys.argv[1]
if mode == "cli":
    from llmft import cli
    cli.main(["train", "/nonexistent.yaml"])  # a user error: the allocator is set before it
elif mode == "call":
    from llmft.job.malloc import use_mmap_for_large_blocks
    got["set_here"] = use_mmap_for_large_blocks()
elif mode == "train":  # a real `llmft train`: the threshold where the steps start
    from llmft import cli
    from llmft.training import run
    loop = run.train_loop

    def probed(*a, **k):
        got["steps"] = probe()
        return loop(*a, **k)

    run.train_loop = probed
    assert cli.main(["train", sys.argv[2]]) == 0
elif mode == "settle-alone":  # a library caller that never set the loading threshold
    from llmft.job.malloc import settle_for_steps
    got["set_here"] = settle_for_steps()
got.update(probe())
print(json.dumps(got))
"""


def _probe(*args: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], env={**base, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_by_default_a_freed_block_moves_the_threshold():
    assert _probe("none") == {"8": False, "24": True}


def test_a_heavy_command_loads_with_large_blocks_mapped():
    assert _probe("cli") == {"8": True, "24": True}


def test_the_steps_run_with_a_fixed_32_mib_threshold(tmp_path):
    recipe = write_recipe(tmp_path)
    got = _probe("train", str(recipe))
    assert got["steps"] == {"8": False, "24": False}  # both from the heap: fixed at 32 MiB
    assert (got["8"], got["24"]) == (False, False)  # and after the run


def test_only_a_threshold_llmft_set_is_changed_for_the_steps():
    assert _probe("settle-alone") == {"set_here": False, "8": False, "24": True}


def test_the_users_own_setting_wins():
    got = _probe("call", MALLOC_MMAP_THRESHOLD_="33554432")  # 32 MiB: both blocks are heap
    assert got == {"set_here": False, "8": False, "24": False}


def test_mallinfo2_exists():  # the probe's instrument, so that a failure above is about llmft
    assert hasattr(ctypes.CDLL(None), "mallinfo2")
