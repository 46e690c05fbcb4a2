"""Where a run's numbers go: ``metrics.jsonl`` (the record llmft itself reads back) and trackers.

Only the main rank writes. ``metrics.jsonl`` is appended and flushed per row, so a killed run
keeps every row it logged; a resumed run appends to the same file (the later row of a step counts).
Each row then goes to the trackers of ``run.trackers`` (``llmft.metrics.trackers``): TensorBoard, W&B,
MLflow, each step exactly once even across kills and resumes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmft.metrics.trackers import Trackers, selected

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


class Metrics:
    """metrics.jsonl (rank 0, appended, flushed per row), then the recipe's trackers.

    ``info``: what the trackers record as config / params (``tracking.run_info``).
    ``resume``: the trainer state of the checkpoint being resumed (its ``"trackers"`` and
    ``"step"``), so the same tracked runs continue (None for a fresh run).
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        recipe: Recipe,
        *,
        info: dict[str, Any] | None = None,
        resume: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.trackers = None
        if enabled:
            if selected(recipe):
                saved = resume or {}
                self.trackers = Trackers(Path(run_dir), recipe, info or {}, saved.get("trackers"), saved.get("step"))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log(row)

    def tracker_state(self) -> dict[str, Any]:
        """``trainer_state["trackers"]`` for a checkpoint: run ids and last steps sent."""
        return self.trackers.state() if self.trackers is not None else {}

    def summary(self, values: dict[str, Any]) -> None:
        """Run-level facts (final checkpoint, export command) on the tracked runs."""
        if self.trackers is not None:
            self.trackers.summary(values)

    def close(self, stopped: bool = False) -> None:
        """``stopped``: the job was asked to stop and will be resumed (W&B: preempting, MLflow: KILLED)."""
        if self.trackers is not None:
            self.trackers.close(stopped)
