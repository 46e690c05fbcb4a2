"""llmft: one recipe, exact gradient accumulation, checkpoints on boundaries."""

__version__ = "0.1.0"
