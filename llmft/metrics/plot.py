"""``llmft plot RUN_DIR``: train/eval loss, lr and eval metrics of a run, as one PNG; an RL run's
(train rows with ``reward``: train.objective grpo) shows its reward and rollout statistics instead.

matplotlib is imported inside ``plot_run`` (with the Agg backend, so it works on a
headless node); reading the metrics needs only the standard library.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmft.checkpoint.rundir import is_llmft_run
from llmft.errors import Problem, UserError
from llmft.plan.objectives import RL_REWARD

METRICS_FILE = "metrics.jsonl"
# Keys of eval rows that are bookkeeping (counts, timings), not metrics to plot; loss has its own panel.
_NOT_METRICS = {"split", "step", "loss", "tokens", "generated", "samples", "epoch", "time_s", "step_time_s"}

Series = dict[int, float]  # step -> value
# Train metrics that get a panel when a run logs them: the auxiliary loss terms beside ``loss``
# (``aux/<name>``, llmft.model.aux_loss: an MoE's balancing loss) and an MoE's routing (docs/moe.md).
AUX_PREFIX = "aux/"
EXPERT_LOAD = ("moe/load_max_over_mean", "moe/load_max_over_mean_avg")  # the worst layer's, the layers' mean
ROUTER_ENTROPY = "moe/router_entropy"
LR = "learning rate"  # read linearly: a cosine to 0 would stretch a log axis over decades of nothing
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


@dataclass
class Panel:
    """One axis of the PNG: ``series`` by label; ``style`` (by label) holds matplotlib line keywords
    beyond the default; ``stacked``: the series are drawn as a stacked area; ``linear``: the axis
    stays linear whatever the range (else a range over decades, a falling loss, gets a log axis)."""

    title: str
    series: dict[str, Series]
    style: dict[str, dict] = field(default_factory=dict)
    stacked: bool = False
    linear: bool = False


def panels(splits: dict[str, list[dict]]) -> list[tuple[str, dict[str, Series]]]:
    """(title, {label: series}) for each panel that has data: loss (train and eval), learning
    rate, each auxiliary loss (``aux/*``: an MoE's balancing loss), an MoE's expert load and router
    entropy, then one per eval metric (exact_match, perplexity, ...). An RL run's panels are
    ``rl_panels``."""
    return [(p.title, p.series) for p in _run_panels(splits)]


def _run_panels(splits: dict[str, list[dict]]) -> list[Panel]:
    if is_rl(splits):
        return rl_panels(splits)
    train, evals = splits.get("train", []), splits.get("eval", [])
    out: list[Panel] = []
    loss = {name: s for name, s in (("train", _series(train, "loss")), ("eval", _series(evals, "loss"))) if s}
    if loss:
        out.append(Panel("loss", loss))
    if lr := _series(train, "lr"):
        out.append(Panel(LR, {"lr": lr}))
    out += _moe_panels(train)
    for name in _eval_metric_names(evals):
        out.append(Panel(f"eval {name}", {name: _series(evals, name)}))
    return out


def _moe_panels(train: list[dict]) -> list[Panel]:
    out = []
    for name in sorted({k for r in train for k in r if k.startswith(AUX_PREFIX)}):
        if aux := _series(train, name):
            out.append(Panel(name, {name: aux}))
    if load := {key: s for key in EXPERT_LOAD if (s := _series(train, key))}:
        out.append(Panel("expert load, max / mean", load))
    if entropy := _series(train, ROUTER_ENTROPY):
        out.append(Panel("router entropy (nats)", {ROUTER_ENTROPY: entropy}))
    return out


# --- RL runs (docs/rl.md, "Metrics") ------------------------------------------------------------

REWARD_COLUMN = "rewards/"
# With rl.importance_correction: tis, how far the sampler's log-probs are from the trainer's.
MISMATCH_LOGP = ["mismatch/logp_abs_mean", "mismatch/logp_abs_max"]
MISMATCH_WEIGHT = ["mismatch/is_weight_mean", "mismatch/is_weight_min", "mismatch/is_weight_max"]
# Eval rows' keys an RL plot draws in its own panels, or that count rather than measure.
_RL_EVAL_SHOWN = {RL_REWARD, "completion_length", "prompts"}
_EVAL_POINTS = {"marker": "o", "linestyle": ":"}  # a few held-out points over a dense train curve
_RAW = {"color": "C0", "alpha": 0.35, "linewidth": 0.8}  # the noisy per-step curve under its average
_AVERAGE = {"color": "C0", "linewidth": 2.0}


def is_rl(splits: dict[str, list[dict]]) -> bool:
    """An online RL run (train.objective grpo): its train rows carry the step's mean ``reward``."""
    return any(RL_REWARD in r for r in splits.get("train", []))


def average_window(steps: list[int]) -> int:
    """The moving average's window in steps: a tenth of the run's span, so that the curve shows the
    trend at any run length; 1 (no average) below 20 logged steps, where each point reads alone."""
    if len(steps) < 20:
        return 1
    return max(1, round((steps[-1] - steps[0] + 1) / 10))


def moving_average(points: Series, window: int) -> Series:
    """At each step s, the mean of the values logged at steps s - window < t <= s (trailing, as
    TensorBoard smooths; the first points average what there is)."""
    steps = sorted(points)
    out, total, first = {}, 0.0, 0
    for i, s in enumerate(steps):
        total += points[s]
        while steps[first] <= s - window:
            total -= points[steps[first]]
            first += 1
        out[s] = total / (i - first + 1)
    return out


def _informative(panel: Panel) -> bool:
    """A panel whose values are all one number (kl 0 without a reference, a constant lr, a clip
    fraction of 0 on-policy) says nothing the config does not; neither does one without values."""
    values = [v for points in panel.series.values() for v in points.values()]
    return bool(values) and max(values) > min(values)


def rl_panels(splits: dict[str, list[dict]]) -> list[Panel]:
    """An RL run's panels: the reward (per step, its moving average, eval), the reward columns,
    the reward's spread, entropy, KL, clip fraction, completion length and truncation, turns and
    tool calls per episode, the sampler mismatch, the time split per step, a varying lr, any MoE panel and any other eval metric. The
    loss is left out: a policy-gradient surrogate whose value does not track progress. Every panel
    but the reward is left out when it holds no values or one value over the whole run."""
    train, evals = splits.get("train", []), splits.get("eval", [])
    out = [_reward_panel(train, evals)]
    columns = sorted({k for r in train for k in r if k.startswith(REWARD_COLUMN)})
    if len(columns) > 1:  # one column is the reward times its weight: the same curve again
        out.append(_columns_panel(train, evals, columns))
    out.append(_keys_panel("reward spread (std)", train, ["reward_group_std", "reward_std"]))
    out.append(_keys_panel("entropy (nats)", train, ["entropy"]))
    out.append(_keys_panel("KL to reference (k3)", train, ["kl"], linear=False))  # may span decades
    out.append(_keys_panel("clip fraction", train, ["clip_fraction"]))
    length = _keys_panel("completion length (tokens)", train, ["completion_length", "completion_length_max"])
    if points := _series(evals, "completion_length"):
        length.series["eval completion_length"] = points
        length.style["eval completion_length"] = _EVAL_POINTS
    out.append(length)
    out.append(_keys_panel("truncated fraction", train, ["truncated_fraction"]))
    # multi-turn episodes: means per episode (docs/rl.md, tools and environments)
    out.append(_keys_panel("per episode", train, ["turns", "tool_calls", "tool_failures", "tool_parse_failures"]))
    out.append(_keys_panel("sampler mismatch |logp| (nats)", train, MISMATCH_LOGP, linear=False))
    out.append(_keys_panel("importance weight", train, MISMATCH_WEIGHT))
    out.append(_keys_panel("rollout staleness (steps)", train, ["rollout_staleness"]))
    # reward calls past their deadline, or whose worker died (rewards in workers: docs/rl.md)
    calls = sorted({k for r in train for k in r if k.startswith(("reward_timeouts/", "reward_failures/"))})
    out.append(_keys_panel("reward calls timed out / failed", train, calls))
    out.append(_time_panel(train))
    out.append(Panel(LR, {"lr": _series(train, "lr")}))
    out += _moe_panels(train)
    for name in _eval_metric_names(evals):
        if name not in _RL_EVAL_SHOWN and not name.startswith(REWARD_COLUMN):
            out.append(Panel(f"eval {name}", {name: _series(evals, name)}, style={name: _EVAL_POINTS}))
    reward = [out[0]] if out[0].series[RL_REWARD] else []  # the headline, drawn even when flat
    return reward + [p for p in out[1:] if _informative(p)]


def _keys_panel(title: str, train: list[dict], keys: list[str], linear: bool = True) -> Panel:
    return Panel(title, {k: s for k in keys if (s := _series(train, k))}, linear=linear)


def _reward_panel(train: list[dict], evals: list[dict]) -> Panel:
    reward = _series(train, RL_REWARD)
    panel = Panel(RL_REWARD, {RL_REWARD: reward}, linear=True)
    if (window := average_window(sorted(reward))) > 1:
        label = f"reward, moving average of {window} steps"
        panel.series[label] = moving_average(reward, window)
        panel.style = {RL_REWARD: _RAW, label: _AVERAGE}
    if points := _series(evals, RL_REWARD):
        panel.series["eval reward"] = points
        panel.style["eval reward"] = {**_EVAL_POINTS, "color": "C1"}
    return panel


def _columns_panel(train: list[dict], evals: list[dict], columns: list[str]) -> Panel:
    """Each reward column's per-step mean (its moving average on a long run) and its eval points."""
    panel = Panel("reward columns", {}, linear=True)
    for i, key in enumerate(columns):
        color = {"color": f"C{i % 10}"}  # a column's train curve and eval points in one colour
        points = _series(train, key)
        label = key
        if (window := average_window(sorted(points))) > 1:
            label, points = f"{key}, moving average of {window} steps", moving_average(points, window)
        if points:
            panel.series[label], panel.style[label] = points, color
        if held_out := _series(evals, key):
            panel.series[f"eval {key}"], panel.style[f"eval {key}"] = held_out, {**_EVAL_POINTS, **color}
    return panel


def _time_panel(train: list[dict]) -> Panel:
    """generation_s (with the vllm backend: its weight sync, sync_s, apart), update_s and the rest
    of step_time_s (rewards, packing, the old log-probs), stacked: their top is the step's time."""
    gen, update, total = (_series(train, k) for k in ("generation_s", "update_s", "step_time_s"))
    sync = _series(train, "sync_s")  # rollout.backend vllm: part of generation_s
    steps = sorted(set(gen) & set(update))
    series = {"generation_s": {s: gen[s] for s in steps}, "update_s": {s: update[s] for s in steps}}
    if sync:
        series = {
            "sync_s": {s: min(sync.get(s, 0.0), gen[s]) for s in steps},
            "generation_s": {s: gen[s] - min(sync.get(s, 0.0), gen[s]) for s in steps},
            "update_s": series["update_s"],
        }
    if steps and all(s in total for s in steps):
        # generation_s is the slowest rank's, step_time_s this rank's: the rest is never below 0.
        series["other"] = {s: max(0.0, total[s] - gen[s] - update[s]) for s in steps}
    return Panel("time per step (s)", series if steps else {}, stacked=True, linear=True)


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write a PNG with one panel per kind of data in ``<run_dir>/metrics.jsonl``; return its path.

    Default ``out``: ``<run_dir>/metrics.png``.
    """
    run_dir = Path(run_dir)
    found = _run_panels(read_metrics(_metrics_path(run_dir)))
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


def _draw(panels: list[Panel], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        name, series = panel.title, panel.series
        if panel.stacked:
            steps = sorted(next(iter(series.values())))
            ax.stackplot(steps, *([p[s] for s in steps] for p in series.values()), labels=list(series), alpha=0.8)
        for label, points in series.items() if not panel.stacked else ():
            steps = sorted(points)
            # A handful of eval points read better with markers; a dense train curve without.
            style = {"marker": "o" if len(steps) <= 50 else None, **panel.style.get(label, {})}
            ax.plot(steps, [points[s] for s in steps], label=label, **style)
        ax.set_ylabel(name)
        values = [v for points in series.values() for v in points.values()]
        # A loss falling from 5 to 0.01 is flat on a linear axis; the lr is read linearly (and
        # a cosine to 0 would stretch a log axis over decades of nothing).
        if not panel.linear and name != LR and min(values) > 0 and max(values) > 20 * min(values):
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
    _draw(
        [Panel(t, s) for t, s in found], out_path, title=" vs ".join(names) if len(names) <= 3 else f"{len(names)} runs"
    )
    return out_path, loss_differences(runs)
