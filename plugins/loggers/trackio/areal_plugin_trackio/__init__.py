"""areal metrics logger for Trackio: ``metrics.loggers: [jsonl, tensorboard, trackio]``."""
