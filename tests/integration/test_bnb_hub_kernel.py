"""bitsandbytes fetches no kernel from the Hub unless the recipe asks (docs/offline.md, docs/design.md
G7): llmft's one import of it, in a fresh process where ``kernels.get_kernel`` records what it is asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A process where bitsandbytes is not imported yet, whose ``kernels.get_kernel`` records what it is asked.
_BNB_PROBE = """
import kernels
asked = []

def get_kernel(repo_id, *args, **kwargs):
    asked.append(repo_id)
    raise RuntimeError("the probe fetches nothing")

kernels.get_kernel = get_kernel
"""


@pytest.mark.parametrize("hub_kernels", [False, True])
def test_bitsandbytes_fetches_its_cpu_kernel_only_when_asked(hub_kernels):
    """bitsandbytes 0.50 asks ``kernels.get_kernel`` for its CPU 4-bit matmul at import (CPUs with
    AVX512-BF16); llmft's one import of it refuses that fetch unless ``model.hub_kernels``."""
    code = _BNB_PROBE + (
        "from llmft.model.quant import import_bitsandbytes\n"
        f"import_bitsandbytes({hub_kernels})\n"
        "from bitsandbytes.backends.cpu import ops\n"
        "print('avx512bf16' if ops.has_avx512bf16() else 'plain', asked)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cpu, _, asked = done.stdout.strip().splitlines()[-1].partition(" ")
    if cpu != "avx512bf16":
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes asks for no kernel on it either way")
    assert asked == ("['kernels-community/quantization-bitsandbytes']" if hub_kernels else "[]")
    assert "Failed to load CPU gemm_4bit_forward" not in done.stderr or hub_kernels  # the refusal is quiet
