"""The mlflow logger against the real MLflow tracking client and stores on disk (the default SQLite database in
the run folder, and a file store): what the trainer logs is read back with ``MlflowClient``, through the
MetricsLogger and through a short real `areal run`."""

from __future__ import annotations

import json
from pathlib import Path
import os

import pytest

from areal_core.metrics import MetricsLogger

CONFIG = {"experiment": "exp", "trial": "t1",
          "actor": {"backend": "fsdp", "optimizer": {"lr": 1e-6}, "extra": {}},
          "rollout": {"sampling": {"stop": ["</answer>", "\n\n"]}}}


@pytest.fixture(autouse=True)
def mlflow_env(monkeypatch):
    """No MLflow variable of the caller's leaks in."""
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        monkeypatch.delenv(var)


def client_for(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def the_run(client, experiment="exp"):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)]


def log_three_steps(run_dir, config=CONFIG):
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "mlflow"], config=config, resume_step=1,
                               progress=False) as logger:
        assert [type(s).__name__ for s in logger.targets] == ["JsonlSink", "MlflowSink"]
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": step / 4, "train/loss": 1.0 / step, "rollout/accepted": step * 8,
                              "eval/pass@4": 0.5, "bad": float("inf"), "note": "text"})
        assert logger.disabled == []


def check_three_steps(client):
    run = the_run(client)
    assert run.info.run_name == "t1" and run.info.status == "FINISHED"
    assert history(client, run.info.run_id, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history(client, run.info.run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert history(client, run.info.run_id, "rollout/accepted") == [(1, 8.0), (2, 16.0), (3, 24.0)]
    assert history(client, run.info.run_id, "eval/pass_4") == [(1, 0.5), (2, 0.5), (3, 0.5)]  # '@' refused by MLflow
    assert set(run.data.metrics) == {"reward/mean", "train/loss", "rollout/accepted", "eval/pass_4"}
    assert run.data.params == {"experiment": "exp", "trial": "t1", "actor.backend": "fsdp",
                               "actor.optimizer.lr": "1e-06", "actor.extra": "{}",
                               "rollout.sampling.stop": '["</answer>", "\\n\\n"]'}
    return run


def test_a_few_steps_land_in_the_default_sqlite_store_in_the_run_folder(tmp_path):
    run_dir = tmp_path / "exp" / "t1"
    log_three_steps(run_dir)
    uri = f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}"
    run = check_three_steps(client_for(uri))
    assert run.data.tags["areal.run_dir"] == str(run_dir)
    assert json.loads((run_dir / "mlflow" / "areal-run.json").read_text()) == {"tracking_uri": uri,
                                                                              "run_id": run.info.run_id}


def test_a_file_store_named_by_mlflow_tracking_uri(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store in maintenance mode
    log_three_steps(tmp_path / "exp" / "t1")
    check_three_steps(client_for(uri))
    assert not (tmp_path / "exp" / "t1" / "mlflow" / "mlflow.db").exists()


def test_resume_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()  # a file store: quicker to make than a database, and resuming is the same
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "exp" / "t1"
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "mlflow"], config=CONFIG, resume_step=1,
                               progress=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"x": float(step)})
    # the checkpoint was at step 2: step 3 is redone
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "mlflow"], config=CONFIG, resume_step=3,
                               progress=False) as logger:
        for step in (3, 4):
            logger.log(step, {"x": 10.0 * step})
    client = client_for(uri)
    run = the_run(client)  # one run, not two
    assert history(client, run.info.run_id, "x") == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]
    assert run.info.status == "FINISHED"


def test_a_short_areal_run_logs_every_step_to_mlflow_as_to_metrics_jsonl(tmp_path):
    """Every step's scalars, and its trained samples as a table artifact equal to completions.jsonl."""
    from areal_core.testing.rl_doubles import areal_run
    from areal_core.testing.samples import assert_samples_table

    proc, run_dir = areal_run(tmp_path, "ml", ["trainer.total_steps=3", "metrics.loggers=[jsonl,tensorboard,mlflow]"],
                              timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    client = client_for(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    run = the_run(client, "areal")
    assert run.info.run_name == "ml" and run.data.params["metrics.loggers"] == '["jsonl", "tensorboard", "mlflow"]'
    keys = {k for row in rows for k, v in row.items() if k not in ("step", "time") and v is not None}
    assert set(run.data.metrics) == keys
    for key in keys:
        expected = [(row["step"], pytest.approx(row[key])) for row in rows if row.get(key) is not None]
        assert history(client, run.info.run_id, key) == expected, key
    # the step's samples: a table artifact per step, in the run folder's store, named in mlflow.loggedArtifacts
    listed = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert listed == [{"path": f"completions/step-{s:06d}.json", "type": "table"} for s in (1, 2, 3)]
    downloaded = Path(client.download_artifacts(run.info.run_id, "completions", str(tmp_path / "got")))
    assert (run_dir / "mlflow" / "artifacts").is_dir() and not (tmp_path / "mlruns").exists()
    for step in (1, 2, 3):
        saved = json.loads((downloaded / f"step-{step:06d}.json").read_text())
        assert_samples_table(run_dir, step, [dict(zip(saved["columns"], r)) for r in saved["data"]])
    assert "metrics logger 'mlflow'" not in (run_dir / "logs" / "actor-rank0.log").read_text()


def test_a_store_mlflow_refuses_is_reported_once_and_the_run_goes_on(tmp_path, monkeypatch):
    from areal_core.testing.rl_doubles import areal_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # without MLFLOW_ALLOW_FILE_STORE
    proc, run_dir = areal_run(tmp_path, "refused", ["trainer.total_steps=2", "metrics.loggers=[jsonl,mlflow]"],
                              timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    log = (run_dir / "logs" / "actor-rank0.log").read_text()
    assert log.count("metrics logger 'mlflow'") == 1, log
    assert "is off for this run (training goes on; metrics.jsonl has every step): MlflowException: " in log
    assert "set `MLFLOW_ALLOW_FILE_STORE=true`" in log and "Traceback" not in log
