"""The wandb logger against the real wandb, offline: what the trainer logs is read back from the run's own
``.wandb`` file (``wandb_records.py``), through the MetricsLogger and through a short real `areal run`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import wandb_records  # noqa: E402

from areal_core.metrics import MetricsLogger  # noqa: E402

CONFIG = {"experiment": "exp", "trial": "t1", "actor": {"backend": "fsdp", "optimizer": {"lr": 1e-6}}}


@pytest.fixture(autouse=True)
def wandb_env(monkeypatch, tmp_path):
    """No W&B variable of the caller's leaks in; W&B's own settings and caches go under tmp_path, never ~."""
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))


def offline_folders(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_a_few_steps_land_in_the_offline_run_with_the_config_and_names(tmp_path):
    run_dir = tmp_path / "exp" / "t1"
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "wandb"], config=CONFIG, resume_step=1,
                               progress=False) as logger:
        assert [type(s).__name__ for s in logger.targets] == ["JsonlSink", "WandbSink"]
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": step / 4, "train/loss": 1.0 / step, "rollout/accepted": step * 8,
                              "bad": float("nan"), "note": "text"})
        assert logger.disabled == []
    (folder,) = offline_folders(run_dir)
    assert wandb_records.history(folder) == {
        step: {"reward/mean": step / 4, "train/loss": 1.0 / step, "rollout/accepted": step * 8}
        for step in (1, 2, 3)}
    run = wandb_records.run_record(folder)
    assert (run.project, run.display_name) == ("exp", "t1")
    assert run.run_id == (run_dir / "wandb" / "areal-run-id").read_text().strip()
    assert folder.name.endswith(f"-{run.run_id}")
    assert wandb_records.config_of(run) == CONFIG


def test_resume_continues_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "exp" / "t1"
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "wandb"], config=CONFIG, resume_step=1,
                               progress=False) as logger:
        for step in (1, 2):
            logger.log(step, {"x": float(step)})
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "wandb"], config=CONFIG, resume_step=3,
                               progress=False) as logger:
        for step in (3, 4):
            logger.log(step, {"x": float(step)})
    first, second = offline_folders(run_dir)
    ids = {wandb_records.run_record(f).run_id for f in (first, second)}
    assert len(ids) == 1 and first.name.endswith(f"-{ids.pop()}")
    assert sorted(wandb_records.history(first)) == [1, 2]
    assert wandb_records.history(second) == {3: {"x": 3.0}, 4: {"x": 4.0}}


def test_wandb_variables_win_over_the_run_names(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_NAME", "named-by-env")
    run_dir = tmp_path / "exp" / "t1"
    with MetricsLogger.for_run(run_dir, loggers=["jsonl", "wandb"], config=CONFIG, progress=False) as logger:
        logger.log(1, {"x": 1.0})
    run = wandb_records.run_record(offline_folders(run_dir)[0])
    assert (run.project, run.display_name) == ("from-env", "named-by-env")


def test_a_short_areal_run_logs_every_step_to_wandb_as_to_metrics_jsonl(tmp_path):
    """Every step's scalars, and its trained samples as the table `completions` equal to completions.jsonl."""
    from areal_core.testing.rl_doubles import areal_run
    from areal_core.testing.samples import assert_samples_table

    proc, run_dir = areal_run(tmp_path, "wb", ["trainer.total_steps=3", "metrics.loggers=[jsonl,tensorboard,wandb]"],
                              timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    (folder,) = offline_folders(run_dir)
    logged = wandb_records.history(folder)
    assert sorted(logged) == [1, 2, 3]
    for row in rows:
        expected = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}
        # the step's samples, as a W&B table file (its reference is flattened into completions/<field> keys)
        table = {k.split("/", 1)[1]: logged[row["step"]].pop(k) for k in list(logged[row["step"]])
                 if k.startswith("completions/")}
        assert logged[row["step"]] == pytest.approx(expected), row["step"]
        assert table["_type"] == "table-file" and table["nrows"] > 0, table
        saved = json.loads((folder / "files" / table["path"]).read_text())
        assert_samples_table(run_dir, row["step"], [dict(zip(saved["columns"], r)) for r in saved["data"]])
    run = wandb_records.run_record(folder)
    assert (run.project, run.display_name) == ("areal", "wb")
    assert wandb_records.config_of(run)["metrics"]["loggers"] == ["jsonl", "tensorboard", "wandb"]
    assert "metrics logger 'wandb'" not in proc.stdout + (run_dir / "logs" / "actor-rank0.log").read_text()


def test_bad_credentials_are_reported_once_and_the_run_goes_on(tmp_path, monkeypatch):
    from areal_core.testing.rl_doubles import areal_run

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "not-a-key")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing is sent anywhere
    proc, run_dir = areal_run(tmp_path, "badkey", ["trainer.total_steps=2", "metrics.loggers=[jsonl,wandb]"],
                              timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    log = (run_dir / "logs" / "actor-rank0.log").read_text()
    assert log.count("metrics logger 'wandb'") == 1, log
    assert "W&B refused the credentials: WANDB_API_KEY invalid" in log
    assert "Fix: set WANDB_API_KEY (or run `wandb login`), or log offline" in log
    assert "Traceback" not in log
    # and on the terminal, once, while the run went on (W&B started beside training, not before step 1)
    assert proc.stdout.count("warning: metrics logger 'wandb'") == 1, proc.stdout
