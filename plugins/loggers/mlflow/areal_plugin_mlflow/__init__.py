"""areal metrics logger for MLflow: ``metrics.loggers: [jsonl, tensorboard, mlflow]``."""
