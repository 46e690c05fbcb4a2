import pytest
from helpers import PLOT_ROWS, write_metrics

from llmft.errors import UserError
from llmft.metrics.plot import panels, plot_run, read_metrics


def test_later_row_of_a_step_wins(tmp_path):
    write_metrics(tmp_path, PLOT_ROWS)
    splits = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in splits["train"]] == [1, 2, 3, 4, 5]
    assert splits["train"][3]["loss"] == 0.9
    assert [r["exact_match"] for r in splits["eval"]] == [0.0, 0.5]
    # Counts (tokens, generated) are not metrics: no panel for them.
    shown = panels(splits)
    assert [title for title, _ in shown] == ["loss", "learning rate", "eval exact_match", "eval perplexity"]
    assert shown[0][1]["train"][4] == 0.9 and set(shown[0][1]) == {"train", "eval"}


def test_train_only_and_custom_out(tmp_path):
    write_metrics(tmp_path / "run", [{"split": "train", "step": 1, "loss": 2.0}])
    out = plot_run(tmp_path / "run", tmp_path / "plots" / "p.png")
    assert out == tmp_path / "plots" / "p.png" and out.stat().st_size > 0


# --- llmft runs: several runs in one PNG ---------------------------------------------------------


def _train_rows(losses, lr=1e-3):
    return [{"split": "train", "step": s, "loss": v, "lr": lr} for s, v in enumerate(losses, start=1)]


def test_runs_overlay_and_table(tmp_path):
    from llmft.metrics.plot import compare_runs

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
    from llmft.metrics.plot import compare_runs

    write_metrics(tmp_path / "a", _train_rows([1.0]))
    with pytest.raises(UserError, match="--labels: gives 2 label"):
        compare_runs([tmp_path / "a"], tmp_path / "x.png", labels=["x", "y"])
