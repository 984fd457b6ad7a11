"""The ``mlflow`` metrics logger: each step's scalars to an MLflow run.

The store is ``MLFLOW_TRACKING_URI`` when set (a server, ``sqlite:///...``, or a ``file:`` store, which MLflow 3
only opens with ``MLFLOW_ALLOW_FILE_STORE=true``), else ``sqlite:///<run_dir>/mlflow/mlflow.db``, MLflow's own
default backend, made on first use; ``mlflow ui --backend-store-uri <that>`` shows it. The experiment is
``MLFLOW_EXPERIMENT_NAME`` or the run's ``experiment``, the run's name its ``trial``; the resolved run config is
logged as parameters (``actor.optimizer.lr``, ...). The trained samples' prompts and completions
(``completions.jsonl``) go to a table artifact ``completions/step-<N>.json`` per step (under
``<run_dir>/mlflow/artifacts/`` with the default store). The run's id and store are kept in
``<run_dir>/mlflow/areal-run.json``, so ``areal run --resume`` continues the same MLflow run.

mlflow is imported when the logger is built, never when the plugin is listed.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from areal_core.completions import table_rows
from areal_core.metrics import finite_scalars, import_for_logger, run_names

RUN_FILE = "areal-run.json"
TABLE_FOLDER = "completions"  # the trained samples, one table artifact per step that writes them
MAX_LISTED_TABLES = 50  # the newest tables named in the run's mlflow.loggedArtifacts tag (a tag holds 8000 chars)
MAX_PARAMS_PER_BATCH = 100  # MLflow's limits per log_batch call
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_LENGTH = 6000
_INVALID_KEY_CHARS = re.compile(r"[^/\w.\- ]")  # MLflow accepts letters, digits, _ - . space and /


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}"


def metric_key(key: str) -> str:
    """``key`` with every character MLflow refuses in a name replaced by ``_``."""
    return _INVALID_KEY_CHARS.sub("_", str(key))


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Dotted keys and text values of a nested config (lists as JSON), each value at most MLflow's limit."""
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{prefix}{key}.")
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        yield metric_key(f"{prefix}{key}"), text[:MAX_PARAM_LENGTH]


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class MlflowSink:
    """One MLflow run per areal run; ``write`` logs a step's finite scalars at that step."""

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        tracking = import_for_logger("mlflow.tracking", "mlflow", "areal-plugin-mlflow")
        from mlflow.entities import Metric, Param

        self._metric = Metric
        self.run_dir = Path(run_dir)
        config = dict(config or {})
        experiment, trial = run_names(self.run_dir, config)
        (self.run_dir / "mlflow").mkdir(parents=True, exist_ok=True)
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(self.run_dir)
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        self._tables: list[dict] = []
        self.run_id = self._stored_run()
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment
        experiment = self.client.get_experiment_by_name(name)
        # the default store keeps its artifacts (the completion tables) beside it, not in the current folder
        location = (None if os.environ.get("MLFLOW_TRACKING_URI") else
                    (self.run_dir / "mlflow" / "artifacts").resolve().as_uri())
        experiment_id = (experiment.experiment_id if experiment is not None else
                         self.client.create_experiment(name, artifact_location=location))
        run = self.client.create_run(experiment_id, run_name=trial,
                                     tags={"areal.run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        params = [Param(key, value) for key, value in flatten(config)]
        for chunk in _chunks(params, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)
        (self.run_dir / "mlflow" / RUN_FILE).write_text(
            json.dumps({"tracking_uri": self.tracking_uri, "run_id": self.run_id}) + "\n", encoding="utf-8")

    def _stored_run(self) -> str | None:
        """The run an earlier start of this areal run made in the same store, if it is still there."""
        try:
            stored = json.loads((self.run_dir / "mlflow" / RUN_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("tracking_uri") != self.tracking_uri:
            return None
        run_id = stored.get("run_id")
        try:
            run = self.client.get_run(run_id)
        except Exception:  # deleted, or another store under the same address
            return None
        return run_id if run.info.lifecycle_stage == "active" else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(metric_key(key), float(number), now, int(step))
                 for key, number in finite_scalars(metrics).items()]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def write_samples(self, step: int, records: list[dict]) -> None:
        """The step's samples as an MLflow table (the run's artifact ``completions/step-<N>.json``, which the
        UI's evaluation view lists): written as MLflow writes a table, ``{"columns": [...], "data": [...]}``,
        and registered in the run's ``mlflow.loggedArtifacts`` tag, without needing pandas (mlflow-skinny has
        none; MlflowClient.log_table requires it)."""
        columns, rows = table_rows(records)
        artifact = f"{TABLE_FOLDER}/step-{int(step):06d}.json"
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, artifact)
        self._tables.append({"path": artifact, "type": "table"})
        self.client.set_tag(self.run_id, "mlflow.loggedArtifacts", json.dumps(self._tables[-MAX_LISTED_TABLES:]))

    def close(self) -> None:
        run_id, self.run_id = self.run_id, None
        if run_id is not None:
            self.client.set_terminated(run_id, "FINISHED")

    def __repr__(self) -> str:
        return f"MlflowSink(run {self.run_id}, {self.tracking_uri})"
