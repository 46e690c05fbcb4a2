"""Where a run's numbers go: ``metrics.jsonl`` (the record llmft itself reads back) and trackers.

Only the main rank writes. ``metrics.jsonl`` is appended and flushed per row, so a killed run
keeps every row it logged; a resumed run appends to the same file (the later row of a step counts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Metrics:
    """metrics.jsonl (rank 0, appended, flushed per row) and optional TensorBoard events."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self.tb.add_scalar(f"{row['split']}/{k}", v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
