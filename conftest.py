"""Settings of the whole suite (tests/ and every plugin's tests/), checked once before any test runs."""

import pytest


def pytest_configure(config):
    from areal_core.testing.waits import timeout_scale

    try:
        timeout_scale()  # AREAL_TEST_TIMEOUT_SCALE: a bad value is a usage error, not a failure in every test
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
