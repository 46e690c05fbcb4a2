"""``llmft plot RUN_DIR``: train/eval loss, lr and eval metrics of a run, as one PNG.

matplotlib is imported inside ``plot_run`` (with the Agg backend, so it works on a
headless node); reading the metrics needs only the standard library.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from llmft.checkpoint.rundir import is_llmft_run
from llmft.errors import Problem, UserError

METRICS_FILE = "metrics.jsonl"
# Keys of eval rows that are bookkeeping (counts, timings), not metrics to plot; loss has its own panel.
_NOT_METRICS = {"split", "step", "loss", "tokens", "generated", "samples", "epoch", "time_s", "step_time_s"}

Series = dict[int, float]  # step -> value
# Train metrics that get a panel when a run logs them: the auxiliary loss terms beside ``loss``
# (``aux/<name>``, llmft.model.aux_loss: an MoE's balancing loss) and an MoE's routing (docs/moe.md).
AUX_PREFIX = "aux/"
EXPERT_LOAD = ("moe/load_max_over_mean", "moe/load_max_over_mean_avg")  # the worst layer's, the layers' mean
ROUTER_ENTROPY = "moe/router_entropy"
# Every PNG llmft plot / llmft runs writes says so in its Software text chunk; an existing file
# at the output path without it is the user's, and is never replaced.
SOFTWARE = "llmft plot"


def written_by_plot(path: Path, older: bool = False) -> bool:
    """``older``: also a plain matplotlib PNG (llmft plot before it signed its files)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    signs = [SOFTWARE, *(["Matplotlib"] if older else [])]
    return head.startswith(b"\x89PNG") and any(b"tEXtSoftware\x00" + s.encode() in head for s in signs)


def check_out(path: Path, older: bool = False) -> None:
    """Refuse to replace a file (or a link) at ``path`` that llmft plot did not write."""
    if (path.exists() or path.is_symlink()) and (path.is_symlink() or not written_by_plot(path, older)):
        raise UserError(
            Problem(
                str(path),
                "exists and was not written by llmft plot; it would be replaced",
                "Pass another --out, or move that file away.",
            )
        )


def read_metrics(path: Path) -> dict[str, list[dict]]:
    """Rows by split, one per step, in step order. A step logged twice (a run killed after
    logging it, then resumed) keeps its later row, as the metrics contract says."""
    by_split: dict[str, dict[int, dict]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write leaves a torn last line; skip it rather than refuse to plot.
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(
                Problem(
                    f"{path}:{lineno}",
                    "is not a metrics row (a JSON object with an integer step)",
                    "Point llmft plot at a run directory written by llmft train.",
                )
            )
        by_split.setdefault(str(row.get("split", "train")), {})[row["step"]] = row
    return {split: [rows[s] for s in sorted(rows)] for split, rows in by_split.items()}


def _series(rows: list[dict], key: str) -> Series:
    out = {}
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[r["step"]] = float(v)
    return out


def _eval_metric_names(rows: list[dict]) -> list[str]:
    names = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(names - _NOT_METRICS)


def _metrics_path(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise UserError(
            Problem(str(run_dir), "run directory not found", "Pass the run.output_dir of a run (e.g. runs/quickstart).")
        )
    path = run_dir / METRICS_FILE
    if not path.is_file() or path.stat().st_size == 0:
        raise UserError(
            Problem(
                str(path),
                "no metrics to plot",
                "Train first (llmft train RECIPE); metrics.jsonl appears after the first logged step.",
            )
        )
    return path


def panels(splits: dict[str, list[dict]]) -> list[tuple[str, dict[str, Series]]]:
    """(title, {label: series}) for each panel that has data: loss (train and eval), learning
    rate, each auxiliary loss (``aux/*``: an MoE's balancing loss), an MoE's expert load and router
    entropy, then one per eval metric (exact_match, perplexity, ...)."""
    train, evals = splits.get("train", []), splits.get("eval", [])
    out: list[tuple[str, dict[str, Series]]] = []
    loss = {name: s for name, s in (("train", _series(train, "loss")), ("eval", _series(evals, "loss"))) if s}
    if loss:
        out.append(("loss", loss))
    if lr := _series(train, "lr"):
        out.append(("learning rate", {"lr": lr}))
    for name in sorted({k for r in train for k in r if k.startswith(AUX_PREFIX)}):
        if aux := _series(train, name):
            out.append((name, {name: aux}))
    if load := {key: s for key in EXPERT_LOAD if (s := _series(train, key))}:
        out.append(("expert load, max / mean", load))
    if entropy := _series(train, ROUTER_ENTROPY):
        out.append(("router entropy (nats)", {ROUTER_ENTROPY: entropy}))
    for name in _eval_metric_names(evals):
        out.append((f"eval {name}", {name: _series(evals, name)}))
    return out


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write a PNG with one panel per kind of data in ``<run_dir>/metrics.jsonl``; return its path.

    Default ``out``: ``<run_dir>/metrics.png``.
    """
    run_dir = Path(run_dir)
    found = panels(read_metrics(_metrics_path(run_dir)))
    if not found:
        raise UserError(
            Problem(
                str(run_dir / METRICS_FILE),
                "holds no loss, lr or eval metric values",
                "Check that the run logged at least one step.",
            )
        )
    out_path = Path(out) if out is not None else run_dir / "metrics.png"
    check_out(out_path, older=out is None and is_llmft_run(run_dir))  # a run's own, as an older llmft plotted it
    _draw(found, out_path, title=run_dir.name)
    return out_path


def _draw(panels: list[tuple[str, dict[str, Series]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, series) in zip(axes[:, 0], panels, strict=True):
        for label, points in series.items():
            steps = sorted(points)
            # A handful of eval points read better with markers; a dense train curve without.
            ax.plot(steps, [points[s] for s in steps], label=label, marker="o" if len(steps) <= 50 else None)
        ax.set_ylabel(name)
        values = [v for points in series.values() for v in points.values()]
        # A loss falling from 5 to 0.01 is flat on a linear axis; the lr is read linearly (and
        # a cosine to 0 would stretch a log axis over decades of nothing).
        if name != "learning rate" and min(values) > 0 and max(values) > 20 * min(values):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(LogFormatter())  # "0.1", "40" rather than 10^-1, 4x10^1
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"Software": SOFTWARE})
    plt.close(fig)


# --- llmft runs: several runs' curves in one PNG ---------------------------------------------------


def _labels(run_dirs: list[Path]) -> list[str]:
    """Run dir names; a name shared by several runs gets as many parent folders as tell them apart."""
    parts = [d.resolve().parts for d in run_dirs]
    depth = [1] * len(parts)
    while True:
        labels = ["/".join(p[-k:]) for p, k in zip(parts, depth, strict=True)]
        clashes = [i for i, label in enumerate(labels) if labels.count(label) > 1 and depth[i] < len(parts[i])]
        if not clashes:
            return labels
        for i in clashes:
            depth[i] += 1


def compare_panels(runs: dict[str, dict[str, list[dict]]]) -> list[tuple[str, dict[str, Series]]]:
    """(title, {run label: series}): train loss, eval loss, learning rate; panels without data left out."""
    out = []
    for title, split, key in (
        ("train loss", "train", "loss"),
        ("eval loss", "eval", "loss"),
        ("learning rate", "train", "lr"),
    ):
        series = {label: s for label, splits in runs.items() if (s := _series(splits.get(split, []), key))}
        if series:
            out.append((title, series))
    return out


def loss_differences(runs: dict[str, dict[str, list[dict]]]) -> str:
    """A table: each run's steps and final train loss, and its largest relative train-loss
    difference from the first run over the steps both logged (how "unchanged" the curve is)."""
    labels = list(runs)
    ref = _series(runs[labels[0]].get("train", []), "loss")
    width = max(len(label) for label in labels)
    lines = [f"{'run':<{width}}  steps  final loss  max rel. loss diff vs {labels[0]}"]
    for label in labels:
        loss = _series(runs[label].get("train", []), "loss")
        final = f"{loss[max(loss)]:.6g}" if loss else "-"
        common = sorted(set(loss) & set(ref))
        if label == labels[0]:
            diff = "-"
        elif common:
            worst = max(abs(loss[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in common)
            diff = f"{worst:.3g} over {len(common)} common steps"
        else:
            diff = "no common steps"
        lines.append(f"{label:<{width}}  {len(loss):>5}  {final:>10}  {diff}")
    return "\n".join(lines)


def compare_runs(
    run_dirs: list[str | os.PathLike], out: str | os.PathLike = "runs.png", labels: list[str] | None = None
) -> tuple[Path, str]:
    """``llmft runs``: the train loss, eval loss and lr of several runs overlaid in one PNG.

    Returns the PNG's path and the table of ``loss_differences``.
    """
    dirs = [Path(d) for d in run_dirs]
    if labels is not None and len(labels) != len(dirs):
        raise UserError(
            Problem("--labels", f"gives {len(labels)} label(s) for {len(dirs)} run(s)", "Give one label per run.")
        )
    names = labels or _labels(dirs)
    runs = {name: read_metrics(_metrics_path(d)) for name, d in zip(names, dirs, strict=True)}
    found = compare_panels(runs)
    if not found:
        raise UserError(Problem(", ".join(map(str, dirs)), "hold no loss or lr values", "Train them first."))
    out_path = Path(out)
    check_out(out_path)
    _draw(found, out_path, title=" vs ".join(names) if len(names) <= 3 else f"{len(names)} runs")
    return out_path, loss_differences(runs)
