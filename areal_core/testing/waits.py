"""Waits in tests that do not depend on how fast or how loaded the machine is.

A test waits for the event it needs (a file line, a server's report, a thread's flag) with a generous timeout,
never a fixed sleep before acting on it. Every such timeout goes through :func:`scaled`, so a slow or shared
machine raises them all with one setting: ``AREAL_TEST_TIMEOUT_SCALE=3 python -m pytest`` (DEVELOPERS.md).
A timeout only bounds a wait for something that is expected to come; a test never passes because of it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, TypeVar

T = TypeVar("T")

SCALE_ENV = "AREAL_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """The factor every test timeout is multiplied by: ``AREAL_TEST_TIMEOUT_SCALE`` (default 1)."""
    raw = os.environ.get(SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{SCALE_ENV} is {raw!r}; it must be a number > 0, the factor every test timeout is "
                         f"multiplied by (e.g. {SCALE_ENV}=3 on a slow or busy machine), or unset for 1")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` times :func:`timeout_scale`: the timeout of a wait in a test."""
    return seconds * timeout_scale()


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    """Poll ``condition`` until it returns something truthy and return that; fail after ``scaled(timeout_s)``
    with an AssertionError saying what was waited for and how long (``what``: e.g. "the server to rejoin")."""
    limit = scaled(timeout_s)
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {limit:.1f} s for {what} ({SCALE_ENV}={timeout_scale():g})")
        time.sleep(interval_s)
