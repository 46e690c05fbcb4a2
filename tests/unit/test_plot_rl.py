"""``llmft plot`` of an RL run (train rows with ``reward``, docs/rl.md "Metrics"): the reward with its
moving average and eval points, the rollout statistics and the time split per step; panels that
hold one value over the run (kl 0 without a reference, a constant lr, eval ``prompts``) and the
GRPO loss are left out."""

from __future__ import annotations

import math

import matplotlib.figure
import matplotlib.image
import pytest
from helpers import write_metrics
from test_plot_moe import PANEL_PX

from llmft.metrics.plot import moving_average, panels, plot_run, read_metrics

STEPS = 60  # a moving average of 6 steps: a tenth of the run


def _grpo_rows(**extra) -> list[dict]:
    """A GRPO run of 60 steps: a rising, noisy reward of two columns; no reference (kl 0), a constant
    lr, nothing truncated; eval rows every 20 steps."""
    rows = []
    for s in range(1, STEPS + 1):
        noise = 0.3 * math.sin(7 * s)
        rows.append(
            {
                "split": "train",
                "step": s,
                "loss": 1e-3 * math.cos(s),
                "lr": 1e-6,
                "grad_norm": 1.0 + noise,
                "step_time_s": 3.0 + noise,
                "reward": 0.5 + s / STEPS + noise,
                "rewards/exact": s / STEPS,
                "rewards/per_char": 0.5 + noise,
                "reward_std": 0.4 + noise / 10,
                "reward_group_std": 0.3 + noise / 10,
                "completion_length": 20 - s / 10,
                "completion_length_max": 32,
                "truncated_fraction": 0.0,
                "generation_s": 2.0 + noise / 2,
                "update_s": 0.8,
                "kl": 0.0,
                "clip_fraction": 0.01 * (s % 3),
                "entropy": 2.0 - s / 100,
                **{k: f(s) for k, f in extra.items()},
            }
        )
        if s % 20 == 0:
            rows.append(
                {
                    "split": "eval",
                    "step": s,
                    "reward": s / 40,
                    "rewards/exact": s / 80,
                    "rewards/per_char": s / 80,
                    "completion_length": 18.0,
                    "prompts": 200,
                }
            )
    return rows


@pytest.fixture
def shown(monkeypatch):
    """What each saved figure shows: per panel, its y label and the labels of its lines and of its
    stacked areas (as test_plot_moe's ``drawn``, which sees lines only)."""
    figures = []
    save = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kwargs):
        figures.append(
            [(ax.get_ylabel(), [x.get_label() for x in (*ax.get_lines(), *ax.collections)]) for ax in fig.axes]
        )
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    return figures


def test_an_rl_run_plots_its_reward_and_rollouts_not_its_constants(tmp_path, shown):
    write_metrics(tmp_path / "grpo", _grpo_rows())
    png = plot_run(tmp_path / "grpo")
    average = "reward, moving average of 6 steps"
    assert shown == [
        [
            ("reward", ["reward", average, "eval reward"]),
            (
                "reward columns",
                [
                    "rewards/exact, moving average of 6 steps",
                    "eval rewards/exact",
                    "rewards/per_char, moving average of 6 steps",
                    "eval rewards/per_char",
                ],
            ),
            ("reward spread (std)", ["reward_group_std", "reward_std"]),
            ("entropy (nats)", ["entropy"]),
            ("clip fraction", ["clip_fraction"]),
            ("completion length (tokens)", ["completion_length", "completion_length_max", "eval completion_length"]),
            ("time per step (s)", ["generation_s", "update_s", "other"]),
        ]
    ]  # no loss, learning rate, KL, truncated fraction, eval prompts: one value each over the run
    assert matplotlib.image.imread(png).shape[:2] == (7 * PANEL_PX, 700)

    reward = dict(panels(read_metrics(png.parent / "metrics.jsonl")))["reward"]
    raw = reward["reward"]
    assert reward[average][1] == raw[1] and reward[average][2] == pytest.approx((raw[1] + raw[2]) / 2)
    assert reward[average][STEPS] == pytest.approx(sum(raw[s] for s in range(STEPS - 5, STEPS + 1)) / 6)
    assert reward["eval reward"] == {20: 0.5, 40: 1.0, 60: 1.5}
    times = dict(panels(read_metrics(png.parent / "metrics.jsonl")))["time per step (s)"]
    # step_time_s less generation_s and update_s: (3 + noise) - (2 + noise / 2) - 0.8
    assert times["other"][1] == pytest.approx(0.2 + 0.15 * math.sin(7))


def test_a_varying_lr_the_mismatch_and_kl_are_drawn_an_empty_panel_is_not(tmp_path, shown):
    rows = _grpo_rows(
        lr=lambda s: 1e-6 * min(1.0, s / 10),
        kl=lambda s: 1e-4 * s,
        entropy=lambda s: float("nan"),  # no finite value: no panel
        **{
            "mismatch/logp_abs_mean": lambda s: 1e-7 * (1 + s % 4),
            "mismatch/logp_abs_max": lambda s: 1e-5 * (1 + s % 3),
            "mismatch/is_weight_mean": lambda s: 1.0 + 1e-7 * (s % 2),
            "mismatch/is_weight_min": lambda s: 0.99,
            "mismatch/is_weight_max": lambda s: 1.01,
        },
    )
    write_metrics(tmp_path / "grpo", rows)
    plot_run(tmp_path / "grpo")
    titles = [title for title, _ in shown[0]]
    assert titles == [
        "reward",
        "reward columns",
        "reward spread (std)",
        "KL to reference (k3)",
        "clip fraction",
        "completion length (tokens)",
        "sampler mismatch |logp| (nats)",
        "importance weight",
        "time per step (s)",
        "learning rate",
    ]
    assert dict(shown[0])["importance weight"] == [
        "mismatch/is_weight_mean",
        "mismatch/is_weight_min",
        "mismatch/is_weight_max",
    ]


def test_a_short_run_has_no_moving_average_and_one_column_no_columns_panel():
    rows = [r for r in _grpo_rows() if r["step"] <= 19]  # under 20 logged steps: each point reads alone
    for r in rows:
        r.pop("rewards/per_char", None)
    shown = dict(panels({"train": [r for r in rows if r["split"] == "train"]}))
    assert list(shown["reward"]) == ["reward"] and "reward columns" not in shown
    assert moving_average({1: 1.0, 2: 3.0, 5: 5.0}, 3) == {1: 1.0, 2: 2.0, 5: 5.0}  # by step, not by row


def test_a_tiny_grpo_run_plots_its_reward(tmp_path, shown):
    from grpo_runs import grpo_recipe
    from helpers import train_inproc

    recipe = grpo_recipe(tmp_path / "g", data__eval=str(tmp_path / "g" / "prompts.jsonl"), train__eval_every_steps=1)
    assert train_inproc(recipe, "train.max_steps=2") == 0  # writes metrics.png at the end
    shown.clear()
    plot_run(tmp_path / "g" / "run", tmp_path / "again.png")
    titles = [title for title, _ in shown[0]]
    # File rollouts, SGD, no reference: kl and clip fraction are 0, nothing is truncated, lr constant.
    assert titles == [
        "reward",
        "reward columns",
        "reward spread (std)",
        "entropy (nats)",
        "completion length (tokens)",
        "time per step (s)",
    ]
    assert dict(shown[0])["reward"] == ["reward", "eval reward"]


def test_a_vllm_run_splits_out_its_sync_and_shows_staleness_and_reward_timeouts(tmp_path, shown):
    rows = _grpo_rows(
        sync_s=lambda s: 0.25,
        rollout_staleness=lambda s: 0.0 if s == 1 else 1.0,
        **{"reward_timeouts/exact": lambda s: float(s % 5 == 0), "reward_failures/exact": lambda s: 0.0},
    )
    write_metrics(tmp_path / "grpo", rows)
    plot_run(tmp_path / "grpo")
    drawn = dict(shown[0])
    assert drawn["time per step (s)"] == ["sync_s", "generation_s", "update_s", "other"]
    assert drawn["rollout staleness (steps)"] == ["rollout_staleness"]
    assert drawn["reward calls timed out / failed"] == ["reward_failures/exact", "reward_timeouts/exact"]


def test_an_episode_run_shows_turns_and_tool_calls(tmp_path, shown):
    rows = _grpo_rows(
        turns=lambda s: 1.0 + s / STEPS,
        tool_calls=lambda s: s / STEPS,
        tool_failures=lambda s: 0.1 * (s % 2),
        tool_parse_failures=lambda s: 0.0,
    )
    write_metrics(tmp_path / "grpo", rows)
    plot_run(tmp_path / "grpo")
    drawn = dict(shown[0])
    assert drawn["per episode"] == ["turns", "tool_calls", "tool_failures", "tool_parse_failures"]
