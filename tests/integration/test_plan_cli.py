"""`llmft plan` in a fresh interpreter: it loads no torch (docs/design.md G9)."""

import subprocess
import sys
import textwrap

import pytest

# meta-llama/Llama-3.1-8B: its shape comes from plan.shape's table, nothing is downloaded.
BASE = textwrap.dedent(
    """\
    model:
      name_or_path: meta-llama/Llama-3.1-8B
    data:
      train: train.jsonl
      max_seq_len: 2048
    batch:
      global_batch_size: 64
      micro_batch_size: 1
    train:
      max_steps: 10
    """
)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mem") / "recipe.yaml"
    path.write_text(BASE)
    return str(path)


def test_plan_cli_imports_no_torch(base):
    code = (
        "import sys; from llmft.cli import main; "
        f"rc = main(['plan', {base!r}, 'distributed.gpu_memory_gb=24']); "
        "assert 'torch' not in sys.modules, 'plan imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "total" in proc.stdout
