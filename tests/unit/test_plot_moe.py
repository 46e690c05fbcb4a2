"""``llmft plot`` of a mixture-of-experts run: the balancing loss and the expert load get panels of
their own (docs/moe.md, "What you see"); a dense run's plot has none of them."""

from __future__ import annotations

import matplotlib.figure
import matplotlib.image
import pytest
from helpers import write_metrics

from llmft.metrics.plot import panels, plot_run, read_metrics

DENSE = [{"split": "train", "step": s, "loss": 4.0 / s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 5)]
MOE = [
    {
        **row,
        "aux/moe_balance": 0.5 + 0.1 / row["step"],
        "moe/load_max_over_mean": 2.0 - 0.2 * row["step"],
        "moe/load_max_over_mean_avg": 1.5 - 0.1 * row["step"],
        "moe/router_entropy": 1.9 + 0.01 * row["step"],
    }
    for row in DENSE
]
PANEL_PX = 260  # 2.6 inches per panel at 100 dpi


@pytest.fixture
def drawn(monkeypatch):
    """What each saved figure shows: per panel, its y label and its series' labels."""
    figures = []
    save = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kwargs):
        figures.append([(ax.get_ylabel(), [line.get_label() for line in ax.get_lines()]) for ax in fig.axes])
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    return figures


def test_a_moe_run_plots_its_balancing_loss_and_expert_load(tmp_path, drawn):
    write_metrics(tmp_path / "moe", MOE)
    png = plot_run(tmp_path / "moe")
    assert drawn == [
        [
            ("loss", ["train"]),
            ("learning rate", ["lr"]),
            ("aux/moe_balance", ["aux/moe_balance"]),
            ("expert load, max / mean", ["moe/load_max_over_mean", "moe/load_max_over_mean_avg"]),
            ("router entropy (nats)", ["moe/router_entropy"]),
        ]
    ]
    assert matplotlib.image.imread(png).shape[:2] == (5 * PANEL_PX, 700)
    load = dict(panels(read_metrics(png.parent / "metrics.jsonl")))["expert load, max / mean"]
    assert load["moe/load_max_over_mean"] == {s: 2.0 - 0.2 * s for s in range(1, 5)}


def test_a_dense_run_plots_no_moe_panel(tmp_path, drawn):
    write_metrics(tmp_path / "dense", DENSE)
    png = plot_run(tmp_path / "dense")
    assert drawn == [[("loss", ["train"]), ("learning rate", ["lr"])]]
    assert matplotlib.image.imread(png).shape[:2] == (2 * PANEL_PX, 700)
