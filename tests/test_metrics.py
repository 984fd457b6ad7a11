"""Per-step metrics as a user finds them: metrics.jsonl, TensorBoard events, the
progress bar, and a broken sink that must not stop training."""

from __future__ import annotations

import io
import json
import logging
import math
import struct
import subprocess
import sys
import threading
import time

import pytest

from areal_core.metrics import (
    BackgroundSink,
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    ProgressDisplay,
    TensorboardSink,
    histogram,
    summarize,
)
from areal_core.testing.waits import scaled


def read_jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_writes_one_line_per_step_with_step_time_and_metrics(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.write(0, {"loss": 1.5, "reward/mean": 0.25})
    # flushed at once: readable before close
    assert read_jsonl(tmp_path)[0]["loss"] == 1.5
    sink.write(1, {"loss": float("nan"), "tokens": 7, "note": "not a number"})
    sink.close()
    lines = read_jsonl(tmp_path)
    assert [r["step"] for r in lines] == [0, 1]
    assert all(isinstance(r["time"], float) for r in lines)
    assert lines[0] | {"time": 0} == {"step": 0, "time": 0, "loss": 1.5, "reward/mean": 0.25}
    # strict JSON: NaN becomes null, non-numbers are dropped
    assert lines[1] | {"time": 0} == {"step": 1, "time": 0, "loss": None, "tokens": 7}
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_jsonl_resume_drops_steps_at_or_after_resume_step_then_appends(tmp_path):
    sink = JsonlSink(tmp_path)
    for step in range(5):
        sink.write(step, {"x": float(step)})
    sink.close()

    sink = JsonlSink(tmp_path, resume_step=3)
    assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 1, 2]
    sink.write(3, {"x": 30.0})
    sink.write(4, {"x": 40.0})
    sink.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path)] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_jsonl_reopen_without_resume_step_keeps_everything(tmp_path):
    with MetricsLogger([JsonlSink(tmp_path)]) as logger:
        logger.log(0, {"x": 1.0})
    with MetricsLogger([JsonlSink(tmp_path)]) as logger:
        logger.log(1, {"x": 2.0})
    assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 1]


def test_jsonl_drops_a_trailing_partial_line_from_a_crash(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.write(0, {"x": 1.0})
    sink.write(1, {"x": 2.0})
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "time": 1.0, "x": 3.')  # killed mid-write

    sink = JsonlSink(tmp_path)
    sink.write(2, {"x": 3.0})
    sink.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path)] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def read_tfrecords(path):
    """Parse TFRecord framing (len, crc(len), payload, crc(payload)) into Event protos."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    data = path.read_bytes()
    events, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        assert header_crc == masked_crc32c(header)
        payload = data[pos + 12:pos + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        assert payload_crc == masked_crc32c(payload)
        events.append(Event.FromString(payload))
        pos += 16 + length
    return events


def test_tensorboard_event_file_holds_the_finite_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    sink = TensorboardSink(tmp_path)
    sink.write(0, {"loss": 2.0, "reward/mean": 0.5, "bad": float("inf")})
    sink.write(1, {"loss": 1.0, "reward/mean": float("nan"), "skip": "text"})
    sink.close()

    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars = [
        (value.tag, event.step, value.simple_value)
        for event in read_tfrecords(files[0])
        for value in event.summary.value
    ]
    assert sorted(scalars) == [("loss", 0, 2.0), ("loss", 1, 1.0), ("reward/mean", 0, 0.5)]


def test_progress_on_a_terminal_shows_step_and_fields_and_tolerates_missing_ones():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    display = ProgressDisplay(10, {"reward": "reward/mean", "tokens/s": "tps"}, console=console)
    assert display.enabled
    display.update(0, {"reward/mean": 0.123456, "tps": 12345.6})
    display.update(1, {"tps": "oops"})  # missing reward, non-numeric throughput: no raise
    display.close()
    text = out.getvalue()
    assert "2/10" in text
    assert "reward -" in text and "tokens/s oops" in text
    display.update(2, {})  # after close: silently nothing


def test_progress_writes_nothing_when_not_a_terminal_or_disabled():
    from rich.console import Console

    not_tty = io.StringIO()
    display = ProgressDisplay(10, console=Console(file=not_tty))
    assert not display.enabled
    display.update(0, {"reward/mean": 1.0})
    display.close()

    tty = io.StringIO()
    off = ProgressDisplay(10, enabled=False, console=Console(file=tty, force_terminal=True))
    off.update(0, {"reward/mean": 1.0})
    off.close()
    assert (not_tty.getvalue(), tty.getvalue(), off.enabled) == ("", "", False)


class FailingSink:
    def __init__(self):
        self.calls = 0
        self.closed = False

    def write(self, step, metrics):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        self.closed = True

    def __repr__(self):
        return "FailingSink()"


class ListSink:
    def __init__(self):
        self.rows = []

    def write(self, step, metrics):
        self.rows.append((step, metrics))

    def close(self):
        pass


def test_a_failing_sink_warns_once_is_disabled_and_the_others_go_on(caplog):
    bad, good = FailingSink(), ListSink()
    assert isinstance(bad, MetricsSink)
    with caplog.at_level(logging.WARNING, logger="areal_core.metrics"):
        with MetricsLogger([bad, good]) as logger:
            for step in range(3):
                logger.log(step, {"loss": float(step)})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "FailingSink()" in warnings[0].getMessage() and "disk full" in warnings[0].getMessage()
    assert bad.calls == 1 and bad.closed
    assert [step for step, _ in good.rows] == [0, 1, 2]


def test_for_run_writes_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    with MetricsLogger.for_run(tmp_path, total_steps=2, progress=False) as logger:
        logger.log(0, {"loss": 1.0})
        # metrics.jsonl in the step, the other loggers on threads of their own
        assert [type(s) for s in logger.sinks] == [JsonlSink, BackgroundSink]
    assert read_jsonl(tmp_path)[0]["loss"] == 1.0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


class SlowSink(ListSink):
    """A tracker whose every write waits for ``gate`` (a database, a store that retries) and records the thread it
    ran on."""

    def __init__(self, gate=None, fail_at=None):
        super().__init__()
        self.gate, self.fail_at, self.closed_after = gate, fail_at, None
        self.entered = threading.Event()
        self.threads = set()

    def write(self, step, metrics):
        self.entered.set()
        self.threads.add(threading.get_ident())
        if self.gate is not None:
            self.gate.wait(scaled(30))
        if step == self.fail_at:
            raise OSError("store refused")
        super().write(step, metrics)

    def close(self):
        self.closed_after = len(self.rows)


def test_a_background_sink_never_holds_the_step_and_keeps_every_step_in_order():
    gate = threading.Event()
    slow, failures = SlowSink(gate=gate), []
    sink = BackgroundSink(slow, "slow", lambda step, e: failures.append(step), close_timeout_s=scaled(30))
    for step in range(4):
        sink.write(step, {"loss": float(step)})
    # every write waits for the gate, which opens only now: the step went on without waiting for any of them
    assert slow.rows == [] and not gate.is_set()
    gate.set()
    sink.close()
    assert [(step, m["loss"]) for step, m in slow.rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert slow.closed_after == 4 and failures == []  # closed after the last write, on the writer's thread
    assert slow.threads and threading.get_ident() not in slow.threads


def test_a_background_sink_that_fails_is_reported_once_and_takes_no_more():
    bad, failures = SlowSink(fail_at=1), []
    sink = BackgroundSink(bad, "bad", lambda step, e: failures.append((step, str(e))))
    for step in range(4):
        sink.write(step, {"loss": 0.0})
    sink.close()
    assert failures == [(1, "store refused")] and [s for s, _ in bad.rows] == [0] and bad.closed_after == 1


def test_a_stuck_background_sink_is_named_at_close_and_a_full_queue_drops_steps_once(caplog):
    gate = threading.Event()
    stuck = SlowSink(gate=gate)
    sink = BackgroundSink(stuck, "metrics logger 'stuck'", lambda step, e: None, max_queued=2, close_timeout_s=0.3)
    with caplog.at_level(logging.WARNING, logger="areal_core.metrics"):
        sink.write(0, {"loss": 0.0})
        assert stuck.entered.wait(scaled(10))
        for step in range(1, 6):  # step 0 being written, two queued, three dropped
            sink.write(step, {"loss": 0.0})
        began = time.monotonic()
        sink.close()
    assert time.monotonic() - began < scaled(5)  # close_timeout_s (0.3 s), not the write's wait for the gate
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "steps behind" in m]) == 1
    assert any("metrics logger 'stuck' is 2 steps behind; step 3 and later ones" in m for m in messages)
    assert any(m.startswith("waited 0 s for metrics logger 'stuck' to write its last") for m in messages)
    gate.set()


def test_summarize_and_histogram():
    stats = summarize([1.0, 2.0, 3.0, 4.0], "reward")
    assert stats == pytest.approx(
        {"reward/mean": 2.5, "reward/std": math.sqrt(1.25), "reward/min": 1.0, "reward/max": 4.0})
    assert summarize([], "reward") == {}
    assert histogram([0, 2, 1, 0, 2, 0]) == {0: 3, 1: 1, 2: 2}
    assert list(histogram([3, 1, 2])) == [1, 2, 3]


def test_importing_metrics_and_checkpoint_imports_nothing_heavy():
    code = (
        "import sys, areal_core.metrics, areal_core.checkpoint;"
        "print(sorted(m for m in ('torch', 'numpy', 'tensorboardX', 'rich.progress') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_launcher_announces_evaluations_once_and_not_a_resumed_runs_earlier_ones(tmp_path, capsys):
    """A resumed run's metrics.jsonl still holds the earlier run's rows (its "eval before training" among them,
    and rows after the checkpoint that the trainer is about to drop): shown on the bar, never announced again."""
    from areal_core.processes.follow import MetricsTail
    from areal_core.metrics import truncate_jsonl

    def row(step, after):
        return json.dumps({"step": step, "eval/accuracy": 0.5, "eval/after_step": after, "eval/items": 4}) + "\n"

    path = tmp_path / "metrics.jsonl"
    path.write_text(row(0, 0) + row(3, 3) + row(5, 5))
    fresh = MetricsTail(tmp_path, 10)
    fresh.poll()
    fresh.close()
    said = capsys.readouterr().err
    assert "eval before training" in said and "eval after step 5" in said

    resumed = MetricsTail(tmp_path, 10, announced_until=3)  # resumed from the checkpoint of step 3
    resumed.poll()
    assert "eval" not in capsys.readouterr().err
    truncate_jsonl(path, 4)  # the trainer drops steps after its checkpoint, then evaluates step 5 again
    with open(path, "a") as f:
        f.write(row(5, 5))
    resumed.poll()
    resumed.close()
    assert capsys.readouterr().err.count("eval after step 5") == 1


TRACKER_DOUBLES = '''
"""TEST DOUBLES of trackers whose start-up goes wrong: one waits (a network that does not answer), one fails
after making its folder."""
import time
from pathlib import Path


class SlowStart:
    def __init__(self, run_dir, resume_step=None, config=None):
        time.sleep(3.0)

    def write(self, step, metrics):
        pass

    def close(self):
        pass


class BrokenStart:
    def __init__(self, run_dir, resume_step=None, config=None):
        (Path(run_dir) / "broken-store").mkdir()
        raise RuntimeError("the tracker's store is unreachable")
'''


def test_a_tracker_starts_beside_training_and_one_that_fails_or_hangs_is_said_once_and_leaves_no_folder(tmp_path):
    from areal_core.metrics import WARNINGS_FILE, MetricsLogger
    from areal_core.testing.distributions import install_fake_distribution
    from areal_core.testing.waits import wait_until

    loggers = {"areal.loggers": {"slow_start_double": "tracker_doubles:SlowStart",
                                 "broken_start_double": "tracker_doubles:BrokenStart"}}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    warnings = run_dir / WARNINGS_FILE
    with install_fake_distribution(tmp_path / "site", "areal-test-tracker-doubles", "0.0.1", loggers,
                                   {"tracker_doubles.py": TRACKER_DOUBLES}):
        began = time.monotonic()
        logger = MetricsLogger.for_run(run_dir, loggers=["jsonl", "slow_start_double", "broken_start_double"],
                                       progress=False, start_timeout_s=0.5, warnings_path=warnings)
        logger.log(1, {"x": 1.0})
        assert time.monotonic() - began < 1.0  # the trackers' start-up held nothing (one sleeps 3 s)
        wait_until(lambda: warnings.exists() and "broken_start_double" in warnings.read_text(), 10,
                   "the broken tracker's warning")
        time.sleep(0.6)
        logger.log(2, {"x": 2.0})  # past the start time limit: the slow one is given up
        logger.close()
    said = [json.loads(line)["message"] for line in warnings.read_text().splitlines()]
    assert len(said) == 2, said
    assert "metrics logger 'broken_start_double' from areal-test-tracker-doubles 0.0.1 is off for this run" in said[0]
    assert "RuntimeError: the tracker's store is unreachable" in said[0]
    assert "metrics logger 'slow_start_double'" in said[1] and "did not start within 0.5 s" in said[1]
    assert not (run_dir / "broken-store").exists()  # the empty folder it made is gone
    assert [r["step"] for r in read_jsonl(run_dir)] == [1, 2]


def test_the_launcher_prints_each_of_the_runs_warnings_once(tmp_path, capsys):
    from areal_core.processes.follow import MetricsTail
    from areal_core.metrics import WARNINGS_FILE

    (tmp_path / WARNINGS_FILE).write_text(json.dumps({"time": 0, "message": "from an earlier start"}) + "\n")
    tail = MetricsTail(tmp_path, 10)
    with open(tmp_path / WARNINGS_FILE, "a") as f:
        f.write(json.dumps({"time": 1, "message": "metrics logger 'wandb' is off for this run"}) + "\n")
    tail.poll()
    tail.poll()
    tail.close()
    err = capsys.readouterr().err
    assert err.count("warning: metrics logger 'wandb' is off for this run") == 1 and "earlier start" not in err


class _TableSink:
    """A sink that takes samples (write_samples), failing on them from step ``fail_at`` on."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.steps, self.samples, self.fail_at = [], [], fail_at

    def write(self, step, metrics):
        self.steps.append(step)

    def write_samples(self, step, records):
        if self.fail_at is not None and step >= self.fail_at:
            raise RuntimeError("the tracker refused the table")
        self.samples.append((step, [r["sample"] for r in records]))

    def close(self):
        pass


@pytest.mark.parametrize("background", [False, True])
def test_samples_reach_the_sinks_that_take_them_and_a_failure_there_keeps_their_metrics(tmp_path, background):
    from areal_core.metrics import MetricsLogger

    good, failing, plain = _TableSink(), _TableSink(fail_at=2), JsonlSink(tmp_path / "m")
    logger = MetricsLogger([], warnings_path=tmp_path / "warnings.jsonl")
    for name, sink in (("good", good), ("failing", failing), ("jsonl", plain)):
        logger.sinks.append(logger._in_background(sink, name) if background else sink)
        logger._names[id(logger.sinks[-1])] = name
    records = [{"sample": k} for k in range(3)]
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": 0.5})
        logger.log_samples(step, records)
    logger.log_samples(4, [])  # nothing to show: nothing sent
    logger.close()
    assert good.steps == failing.steps == [1, 2, 3]  # the failing sink's metrics went on
    assert good.samples == [(1, [0, 1, 2]), (2, [0, 1, 2]), (3, [0, 1, 2])]
    assert failing.samples == [(1, [0, 1, 2])]  # step 2 raised: no more samples for it, said once
    said = [json.loads(line)["message"] for line in (tmp_path / "warnings.jsonl").read_text().splitlines()]
    assert len(said) == 1 and "could not take the samples of step 2" in said[0], said
    assert "the tracker refused the table" in said[0] and "its metrics go on" in said[0]


def test_waiting_for_a_tracker_that_failed_to_start_ends_at_its_failure_not_its_time_limit():
    """`MetricsLogger.targets` waits for trackers still starting; one whose start raised is not waited on until
    metrics.logger_start_timeout_s (it was: the loggers test took 60 s, the default limit, per failed logger)."""
    from areal_core.metrics import BackgroundSink

    def broken():
        raise RuntimeError("the tracker refused the key")

    failures = []
    sink = BackgroundSink(None, "broken", lambda step, e: None, build=broken, on_build_failure=failures.append,
                          start_timeout_s=3600)
    answer = []
    waiter = threading.Thread(target=lambda: answer.append(sink.wait_started()), daemon=True)
    waiter.start()
    waiter.join(timeout=60)  # far below the hour it would have waited
    assert not waiter.is_alive() and answer == [None]
    assert [str(e) for e in failures] == ["the tracker refused the key"]
    sink.close()
