"""Settings of the whole suite (tests/ and every plugin's tests/), checked once before any test runs."""

import pytest


def pytest_configure(config):
    from areal_core.testing.waits import timeout_scale

    try:
        timeout_scale()  # AREAL_TEST_TIMEOUT_SCALE: a bad value is a usage error, not a failure in every test
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture(autouse=True)
def _run_secret_stays_with_its_test():
    """A test that draws a run's secret in this process (``areal_core.server_guard.ensure_run_token``: a launcher
    or an evaluation called in-process) must not hand it to the servers later tests start."""
    import os

    from areal_core.server_guard import RUN_TOKEN_ENV

    before = os.environ.get(RUN_TOKEN_ENV)
    yield
    if before is None:
        os.environ.pop(RUN_TOKEN_ENV, None)
    else:
        os.environ[RUN_TOKEN_ENV] = before
