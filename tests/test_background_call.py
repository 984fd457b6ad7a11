"""The trainer's background call (the weight export beside training): result, failure, timeout."""

from __future__ import annotations

import threading

import pytest

from areal_core.trainer import Background


def test_result_and_failure_reach_the_caller():
    assert Background(lambda: 41 + 1, "add", 5.0).result() == 42

    def fail():
        raise ValueError("the server went away")

    with pytest.raises(ValueError, match="the server went away"):
        Background(fail, "fail", 5.0).result()


def test_a_call_past_its_timeout_is_named():
    release = threading.Event()
    call = Background(release.wait, "hand the weights of version 7 to the inference engines", 0.2)
    with pytest.raises(TimeoutError, match="waited 0 s for a background call to hand the weights of version 7"):
        call.result()
    release.set()
