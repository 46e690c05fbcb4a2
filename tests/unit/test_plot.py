import json
import subprocess
import sys

import pytest

from llmft.errors import UserError
from llmft.plot import panels, plot_run, read_metrics


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [
    *({"split": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3 * s / 4, "grad_norm": 1.0} for s in range(1, 5)),
    {"split": "eval", "step": 2, "loss": 3.0, "perplexity": 20.1, "tokens": 90, "exact_match": 0.0, "generated": 8},
    # The run was killed after step 4 and resumed from the checkpoint at step 3: steps 4 and 5 are logged again.
    {"split": "train", "step": 4, "loss": 0.9, "lr": 1e-3, "grad_norm": 1.0},
    {"split": "train", "step": 5, "loss": 0.8, "lr": 1e-3, "grad_norm": 1.0},
    {"split": "eval", "step": 4, "loss": 1.0, "perplexity": 2.7, "exact_match": 0.5},
]


def test_later_row_of_a_step_wins(tmp_path):
    write_metrics(tmp_path, ROWS)
    splits = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in splits["train"]] == [1, 2, 3, 4, 5]
    assert splits["train"][3]["loss"] == 0.9
    assert [r["exact_match"] for r in splits["eval"]] == [0.0, 0.5]
    # Counts (tokens, generated) are not metrics: no panel for them.
    shown = panels(splits)
    assert [title for title, _ in shown] == ["loss", "learning rate", "eval exact_match", "eval perplexity"]
    assert shown[0][1]["train"][4] == 0.9 and set(shown[0][1]) == {"train", "eval"}


def test_cli_writes_a_png(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, ROWS)
    proc = subprocess.run([sys.executable, "-m", "llmft", "plot", str(run)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    png = run / "metrics.png"
    assert str(png) in proc.stdout

    import matplotlib.image

    img = matplotlib.image.imread(png)
    height, width = img.shape[:2]
    # Four panels (loss, lr, eval exact_match, eval perplexity) stacked: taller than wide.
    assert width > 0 and height > width


def test_train_only_and_custom_out(tmp_path):
    write_metrics(tmp_path / "run", [{"split": "train", "step": 1, "loss": 2.0}])
    out = plot_run(tmp_path / "run", tmp_path / "plots" / "p.png")
    assert out == tmp_path / "plots" / "p.png" and out.stat().st_size > 0


def test_missing_dir_and_empty_metrics(tmp_path):
    with pytest.raises(UserError, match="run directory not found.*run.output_dir"):
        plot_run(tmp_path / "nope")
    with pytest.raises(UserError, match="no metrics to plot.*llmft train"):
        plot_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "llmft", "plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "metrics.jsonl" in proc.stderr


# --- llmft runs: several runs in one PNG ---------------------------------------------------------


def _train_rows(losses, lr=1e-3):
    return [{"split": "train", "step": s, "loss": v, "lr": lr} for s, v in enumerate(losses, start=1)]


def test_runs_overlay_and_table(tmp_path):
    from llmft.plot import compare_runs

    write_metrics(tmp_path / "a/run", _train_rows([4.0, 3.0, 2.0, 1.0]) + [{"split": "eval", "step": 4, "loss": 1.5}])
    write_metrics(tmp_path / "b/run", _train_rows([4.0, 3.0, 2.0, 1.0]))
    write_metrics(tmp_path / "c", _train_rows([4.0, 3.3, 2.0]))
    png, table = compare_runs([tmp_path / "a/run", tmp_path / "b/run", tmp_path / "c"], tmp_path / "cmp.png")
    lines = table.splitlines()
    assert lines[0].split() == ["run", "steps", "final", "loss", "max", "rel.", "loss", "diff", "vs", "a/run"]
    assert lines[1].split() == ["a/run", "4", "1", "-"]  # same dir names: told apart by their parents
    assert lines[2].split() == ["b/run", "4", "1", "0", "over", "4", "common", "steps"]
    assert lines[3].split() == ["c", "3", "2", "0.1", "over", "3", "common", "steps"]

    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > img.shape[1]  # train loss, eval loss and lr panels stacked


def test_runs_labels_must_match(tmp_path):
    from llmft.plot import compare_runs

    write_metrics(tmp_path / "a", _train_rows([1.0]))
    with pytest.raises(UserError, match="--labels: gives 2 label"):
        compare_runs([tmp_path / "a"], tmp_path / "x.png", labels=["x", "y"])


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
