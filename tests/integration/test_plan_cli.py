"""`llmft plan` in a fresh interpreter: it loads no torch (docs/design.md G9)."""

import subprocess
import sys

import pytest
from helpers import LLAMA_8B_RECIPE, write_text_recipe


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(write_text_recipe(tmp_path_factory, "mem", LLAMA_8B_RECIPE))


def test_plan_cli_imports_no_torch(base):
    code = (
        "import sys; from llmft.cli import main; "
        f"rc = main(['plan', {base!r}, 'distributed.gpu_memory_gb=24']); "
        "assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "total" in proc.stdout


def test_plan_prints_an_moe_models_total_and_active_parameters_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; from llmft.cli import main; "
        "rc = main(['plan', 'configs/anchors/qwen3-30b-a3b-qlora-1gpu.yaml']); "
        "assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)"
    )
    from helpers import ROOT

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        "parameters 30.5B total / 3.4B active (experts 128, 8 per token): memory counts the total, "
        "FLOPs and MFU the active"
    ) in lines
    assert "fits in 24 GiB (distributed.gpu_memory_gb): NO" in proc.stdout
