"""areal_core.testing.waits: the timeouts of tests, raised together on a slow machine."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_core.testing import scaled, wait_until
from areal_core.testing.waits import SCALE_ENV


def test_timeouts_scale_with_the_environment(monkeypatch):
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert scaled(10) == 10
    monkeypatch.setenv(SCALE_ENV, "2.5")
    assert scaled(10) == 25


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_scale_names_the_variable_the_value_and_the_fix(monkeypatch, value):
    monkeypatch.setenv(SCALE_ENV, value)
    with pytest.raises(ValueError, match=rf"{SCALE_ENV} is '{value}'; it must be a number > 0"):
        scaled(1)


def test_a_bad_scale_stops_pytest_with_a_usage_error_before_any_test():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_timeouts_scale_with_the_environment"],
                          env={**os.environ, SCALE_ENV: "fast"}, capture_output=True, text=True,
                          timeout=scaled(120), cwd=root)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error: no test ran
    assert f"{SCALE_ENV} is 'fast'" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_wait_until_returns_what_came_and_names_what_did_not(monkeypatch):
    monkeypatch.setenv(SCALE_ENV, "2")
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    assert wait_until(lambda: flag.is_set() and "set", 30, "the flag") == "set"
    began = time.monotonic()
    with pytest.raises(AssertionError, match=rf"waited 0.2 s for the flag that never comes \({SCALE_ENV}=2\)"):
        wait_until(lambda: False, 0.1, "the flag that never comes")
    assert time.monotonic() - began >= 0.2
