"""Metrics loggers as plugins (entry-point group ``areal.loggers``, ``metrics.loggers``): the core's built-ins,
the checks before a run, and loggers that fail (cannot be imported, refused at the start, a full disk
mid-run) never stopping training, each reported once with the fix."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.config.validate import validate_run
from areal_core.metrics import JsonlSink, MetricsLogger, TensorboardSink
from areal_core.registry import list_components, resolve
from areal_core.testing.distributions import install_fake_distribution
from areal_core.testing.waits import scaled

DOUBLES = Path(__file__).parent / "doubles"
AREAL = str(Path(sys.executable).with_name("areal"))
LOGGER_DOUBLES = {"recording_double": "logger_doubles:RecordingSinkDouble",
                  "disk_full_double": "logger_doubles:DiskFullSinkDouble",
                  "bad_credentials_double": "logger_doubles:BadCredentialsSinkDouble",
                  "missing_library_double": "logger_doubles:MissingLibrarySinkDouble"}
# the first-party logger plugins, hidden so that the tests see only the core's and the doubles
NO_FIRST_PARTY = "areal-plugin-wandb,areal-plugin-mlflow,areal-plugin-trackio"


@pytest.fixture
def logger_doubles(tmp_path):
    """The doubles installed as ``areal-test-logger-doubles``; yields the folder a subprocess finds them in."""
    with install_fake_distribution(tmp_path / "site", "areal-test-logger-doubles", "0.0.1",
                                   {"areal.loggers": LOGGER_DOUBLES},
                                   {"logger_doubles.py": (DOUBLES / "logger_doubles.py").read_text()}) as site:
        yield site


def test_the_core_ships_jsonl_and_tensorboard_as_loggers_listed_by_areal_plugins():
    core = [(e.name, e.value) for e in list_components("logger") if e.distribution == "areal-core"]
    assert core == [("jsonl", "areal_core.metrics:JsonlSink"), ("tensorboard", "areal_core.metrics:TensorboardSink")]
    assert resolve("logger", "jsonl") is JsonlSink and resolve("logger", "tensorboard") is TensorboardSink
    from areal_core.listing import collect_listing

    listed = next(d for d in collect_listing()["distributions"] if d["distribution"] == "areal-core")
    assert listed["components"]["logger"] == ["jsonl", "tensorboard"]
    shown = subprocess.run([AREAL, "plugins", "--json"], capture_output=True, text=True, timeout=scaled(120))
    core = next(d for d in json.loads(shown.stdout)["distributions"] if d["distribution"] == "areal-core")
    assert core["components"]["logger"] == ["jsonl", "tensorboard"]


def test_the_default_is_todays_jsonl_and_tensorboard():
    run = validate_run(None, [], with_components=False)
    assert run.config.metrics.loggers == ["jsonl", "tensorboard"]
    assert not [p for p in run.problems if p.key == "metrics.loggers"]


def test_metrics_loggers_are_checked_before_the_run(monkeypatch):
    monkeypatch.setenv("AREAL_DISABLE_PLUGINS", NO_FIRST_PARTY)
    run = validate_run(None, ["metrics.loggers=[tensorbord,wandb,tensorbord]"], with_components=False)
    problems = [p for p in run.problems if p.key == "metrics.loggers"]
    assert [str(p) for p in problems] == [
        "[core.loggers] metrics.loggers: [tensorbord, wandb, tensorbord] leaves out jsonl, which is always needed: "
        "the launcher's live bar, `areal plot` and --resume read metrics.jsonl"
        "\n    fix: metrics.loggers=[jsonl, tensorbord, wandb]",
        "[core.loggers] metrics.loggers: [tensorbord, wandb, tensorbord] names tensorbord more than once"
        "\n    fix: name each logger once: metrics.loggers=[tensorbord, wandb]",
        "[core.component] metrics.loggers: [tensorbord, wandb, tensorbord]: no metrics logger named 'tensorbord' is "
        "installed. Did you mean 'tensorboard'? Available: jsonl (areal-core 0.1.0), tensorboard (areal-core 0.1.0)"
        "\n    fix: correct metrics.loggers, or install a plugin that provides metrics logger 'tensorbord' (areal "
        "plugins lists what is installed)",
        "[core.component] metrics.loggers: [tensorbord, wandb, tensorbord]: no metrics logger named 'wandb' is "
        "installed. Available: jsonl (areal-core 0.1.0), tensorboard (areal-core 0.1.0)"
        "\n    fix: install areal-plugin-wandb, which provides it: pip install --find-links dist 'areal-rl[wandb]' "
        "(the wheels scripts/build_wheels.sh builds; not on the package index yet), or in a checkout pip install "
        "-e plugins/loggers/wandb; or leave "
        "'wandb' out of metrics.loggers",
    ]


@pytest.mark.parametrize("value, words", [
    ("[]", "leaves out jsonl"),
    ("['']", "metrics.loggers: item 0 ('') is empty"),
    ("jsonl", "metrics.loggers: 'jsonl' (str) is not a list"),
])
def test_a_malformed_metrics_loggers_is_named(value, words):
    run = validate_run(None, [f"metrics.loggers={value}"], with_components=False)
    shown = [str(p) for p in run.problems if p.key.startswith("metrics.loggers")]
    assert any(words in text for text in shown), shown


def test_areal_check_refuses_an_unknown_logger_without_a_traceback(monkeypatch):
    import os

    env = {**os.environ, "AREAL_DISABLE_PLUGINS": NO_FIRST_PARTY}
    proc = subprocess.run([AREAL, "check", "metrics.loggers=[jsonl,mlflow]"], capture_output=True, text=True,
                          timeout=scaled(120), env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "metrics.loggers: [jsonl, mlflow]: no metrics logger named 'mlflow' is installed" in out
    assert "fix: install areal-plugin-mlflow, which provides it" in out and "Traceback" not in out


def test_for_run_builds_the_named_loggers_and_reports_each_broken_one_once(logger_doubles, tmp_path, caplog):
    run_dir = tmp_path / "run"
    names_given = ["jsonl", "recording_double", "missing_library_double", "bad_credentials_double",
                   "disk_full_double"]
    with caplog.at_level(logging.WARNING, logger="areal_core.metrics"):
        with MetricsLogger.for_run(run_dir, loggers=names_given, config={"experiment": "exp"}, resume_step=1,
                                   progress=False) as logger:
            assert [type(s).__name__ for s in logger.targets] == ["JsonlSink", "RecordingSinkDouble",
                                                                "DiskFullSinkDouble"]
            for step in (1, 2, 3, 4):
                logger.log(step, {"x": float(step)})
    # the trackers start on threads of their own: their reports come in any order
    said = sorted(r.getMessage() for r in caplog.records)
    assert len(said) == 3, said
    assert said[2] == ("metrics logger 'missing_library_double' from areal-test-logger-doubles 0.0.1 is off for this "
                       "run (training goes on; metrics.jsonl has every step): ModuleNotFoundError: No module named "
                       "'areal_test_tracker_library_that_is_not_installed'. Fix: install what it needs (`pip install "
                       "--force-reinstall areal-test-logger-doubles` brings its dependencies), or leave "
                       "'missing_library_double' out of metrics.loggers")
    assert said[0] == ("metrics logger 'bad_credentials_double' from areal-test-logger-doubles 0.0.1 is off for this "
                       "run (training goes on; metrics.jsonl has every step): the tracker refused the API key 'abc…' "
                       "(401 Unauthorized). Fix: set TRACKER_API_KEY to a valid key, or leave bad_credentials_double "
                       "out of metrics.loggers")
    assert said[1] == ("metrics logger 'disk_full_double' (DiskFullSinkDouble()) failed at step 2 and is off for the "
                       "rest of the run (training goes on; metrics.jsonl has every step): OSError: [Errno 28] No space "
                       "left on device: 'tracker-cache/events.bin'. Fix: correct the cause and continue with --resume "
                       "to log to it again (from the last checkpoint), or leave it out of metrics.loggers")
    assert (run_dir / "disk_full_writes").read_text() == "2"  # never called again after it failed
    recorded = [json.loads(line) for line in (run_dir / "recorded.jsonl").read_text().splitlines()]
    assert recorded == [{"step": s, "metrics": {"x": float(s)}, "resume_step": 1, "experiment": "exp"}
                        for s in (1, 2, 3, 4)]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_jsonl_failing_to_start_stops_the_run(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()  # cannot be opened as a file
    with pytest.raises(IsADirectoryError):
        MetricsLogger.for_run(tmp_path, loggers=["jsonl"], progress=False)


def test_a_run_with_broken_loggers_trains_to_the_end_and_reports_each_once(logger_doubles, tmp_path, monkeypatch):
    """The issue's case through a real `areal run` (the RL doubles' stack): a logger whose library is missing,
    one refused at the start, one whose disk fills at step 2; rank 0's log says each once, with the fix."""
    from areal_core.testing.rl_doubles import areal_run

    monkeypatch.setenv("PYTHONPATH", str(logger_doubles))
    proc, run_dir = areal_run(tmp_path, "broken", [
        "trainer.total_steps=3",
        "metrics.loggers=[jsonl,tensorboard,missing_library_double,bad_credentials_double,disk_full_double,"
        "recording_double]"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert [json.loads(line)["step"] for line in (run_dir / "recorded.jsonl").read_text().splitlines()] == [1, 2, 3]
    log = (run_dir / "logs" / "actor-rank0.log").read_text()
    for name in ("missing_library_double", "bad_credentials_double", "disk_full_double"):
        assert log.count(f"metrics logger '{name}'") == 1, (name, log)
    assert "Fix: set TRACKER_API_KEY to a valid key" in log
    assert "failed at step 2 and is off for the rest of the run" in log
    assert "Traceback" not in log


def test_the_helpers_for_plugin_loggers():
    from areal_core.metrics import SinkError, finite_scalars, import_for_logger, run_names

    with pytest.raises(SinkError) as caught:
        import_for_logger("areal_test_tracker_library_that_is_not_installed.client", "mine", "areal-plugin-mine")
    assert caught.value.fix == ("pip install areal-plugin-mine (it brings "
                                "areal_test_tracker_library_that_is_not_installed), or leave mine out of metrics.loggers")
    assert import_for_logger("json", "mine", "areal-plugin-mine") is json
    assert run_names(Path("runs/exp/t1"), {}) == ("exp", "t1")
    assert run_names(Path("runs/exp/t1"), {"experiment": "e", "trial": "t"}) == ("e", "t")
    assert finite_scalars({"a": 1, "b": 2.5, "c": True, "d": float("nan"), "e": "x", "f": float("-inf")}) == {
        "a": 1, "b": 2.5, "c": 1}
