"""Checkpoints: the layout of a run directory (``layout``) and the writer that owns it (``manager``).

``layout`` is pure (no torch) and is what export, consolidation and resume read; each engine
owns the format of its model and optimizer part (``llmft.engines``).
"""

from llmft.checkpoint.layout import (
    CHECKPOINTS,
    TrainerState,
    latest_checkpoint,
    resolve_checkpoint,
    step_dirs,
)

__all__ = ["CHECKPOINTS", "TrainerState", "latest_checkpoint", "resolve_checkpoint", "step_dirs"]
