"""The trackio logger against the real trackio, on a local store in a temporary folder: what the trainer logs is
read back from trackio's own database, through the MetricsLogger and through a short real `areal run`. Each
step runs in its own process (``trackio_script.py``): trackio reads TRACKIO_DIR once, at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing import scaled

SCRIPT = str(Path(__file__).with_name("trackio_script.py"))


@pytest.fixture
def trackio_env(tmp_path, monkeypatch):
    """Trackio's store (and Hugging Face's cache) under tmp_path; nothing sent to a Space or a server."""
    for var in [v for v in os.environ if v.startswith("TRACKIO_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio-store"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return dict(os.environ)


def script(env, *args):
    done = subprocess.run([sys.executable, SCRIPT, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=scaled(300))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def runs_of(env, project):
    return json.loads(script(env, "read", project).splitlines()[-1])


def expected_rows(steps):
    return [{"step": s, "reward/mean": s / 4, "train/loss": 1.0 / s, "rollout/accepted": s * 8} for s in steps]


def test_a_few_steps_land_in_the_trackio_store_with_the_config_and_names(trackio_env, tmp_path):
    run_dir = tmp_path / "exp" / "t1"
    script(trackio_env, "log", run_dir, 1, 3)
    (run,) = runs_of(trackio_env, "exp")
    assert run["name"] == "t1" and run["rows"] == expected_rows([1, 2, 3])
    assert run["config"] == {"experiment": "exp", "trial": "t1",
                             "actor": {"backend": "fsdp", "optimizer": {"lr": 1e-6}}}
    assert json.loads((run_dir / "trackio" / "areal-run.json").read_text()) == {
        "project": "exp", "name": "t1", "run_id": run["id"]}


def test_resume_continues_the_same_run_and_a_fresh_start_makes_a_new_one(trackio_env, tmp_path):
    script(trackio_env, "log", tmp_path / "exp" / "t1", 1, 3)
    script(trackio_env, "log", tmp_path / "exp" / "t1", 3, 4)  # --resume from the checkpoint of step 2
    script(trackio_env, "log", tmp_path / "elsewhere" / "t1", 1, 1)  # another run folder, same names
    first, second = runs_of(trackio_env, "exp")
    assert first["rows"] == expected_rows([1, 2, 3, 3, 4])  # step 3 logged again by the resumed run
    assert second["rows"] == expected_rows([1])


def test_a_short_areal_run_logs_every_step_to_trackio_as_to_metrics_jsonl(trackio_env, tmp_path):
    """Every step's scalars, and its trained samples as the table `completions` equal to completions.jsonl."""
    from areal_core.testing.rl_doubles import areal_run
    from areal_core.testing.samples import assert_samples_table

    proc, run_dir = areal_run(tmp_path, "tk", ["trainer.total_steps=3", "metrics.loggers=[jsonl,trackio]"],
                              timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run,) = runs_of(trackio_env, "areal")
    assert run["name"] == "tk" and run["config"]["metrics"]["loggers"] == ["jsonl", "trackio"]
    scalars = [r for r in run["rows"] if "completions" not in r]
    tables = [r for r in run["rows"] if "completions" in r]
    assert [r["step"] for r in scalars] == [r["step"] for r in rows] == [1, 2, 3]
    for logged, row in zip(scalars, rows):
        assert logged == pytest.approx({k: v for k, v in row.items() if k != "time" and v is not None})
    assert [t["step"] for t in tables] == [1, 2, 3]  # the step's samples, as the Trackio table `completions`
    for table in tables:
        assert table["completions"]["_type"] == "trackio.table"
        assert_samples_table(run_dir, table["step"], table["completions"]["_value"])
    assert "metrics logger 'trackio'" not in (run_dir / "logs" / "actor-rank0.log").read_text()
