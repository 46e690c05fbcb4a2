"""Checkpoints back to ordinary model directories: consolidation, ``llmft export``, the model card."""
