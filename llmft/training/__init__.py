"""A training run: the ``llmft train`` and ``llmft verify`` commands, the run, its loop, eval and reports."""
