"""`llmft plot` and `llmft runs` as commands (the plotting itself is in tests/unit/test_plot.py)."""

import subprocess
import sys

import pytest
from helpers import PLOT_ROWS, write_metrics

from llmft.errors import UserError
from llmft.metrics.plot import plot_run


def test_cli_writes_a_png(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, PLOT_ROWS)
    proc = subprocess.run([sys.executable, "-m", "llmft", "plot", str(run)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    png = run / "metrics.png"
    assert str(png) in proc.stdout

    import matplotlib.image

    img = matplotlib.image.imread(png)
    height, width = img.shape[:2]
    # Four panels (loss, lr, eval exact_match, eval perplexity) stacked: taller than wide.
    assert width > 0 and height > width


def test_missing_dir_and_empty_metrics(tmp_path):
    with pytest.raises(UserError, match="run directory not found.*run.output_dir"):
        plot_run(tmp_path / "nope")
    with pytest.raises(UserError, match="no metrics to plot.*llmft train"):
        plot_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "llmft", "plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "metrics.jsonl" in proc.stderr


def test_runs_cli_shows_accumulation_leaves_the_curve_unchanged(tmp_path):
    """The use case: micro 4 x accumulation 2 and micro 2 x accumulation 4 (global 8) are the
    same run; `llmft runs` shows it in numbers and one PNG."""
    from helpers import train_inproc, write_recipe

    for name, micro in (("micro4", 4), ("micro2", 2)):
        (tmp_path / name).mkdir()
        recipe = write_recipe(tmp_path / name, batch__micro_batch_size=micro, train__max_steps=3)
        assert train_inproc(recipe) == 0
    out = tmp_path / "cmp.png"
    cmd = [sys.executable, "-m", "llmft", "runs", str(tmp_path / "micro4/run"), str(tmp_path / "micro2/run")]
    proc = subprocess.run([*cmd, "--out", str(out), "--labels", "micro4,micro2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("micro2"))
    assert row.split()[1] == "3" and float(row.split()[3]) < 1e-5 and row.endswith("over 3 common steps")
    assert f"wrote {out}" in proc.stdout and out.stat().st_size > 0
