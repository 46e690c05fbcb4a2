"""A run's numbers: metrics.jsonl, trackers, plots, FLOPs and MFU."""
