"""areal metrics logger for Weights & Biases: ``metrics.loggers: [jsonl, tensorboard, wandb]``."""
