"""The simulated runs in these tests train with the core's policy-gradient algorithm double (``rl_pg_double``,
from :mod:`areal_core.testing.rl_doubles`), so the plugin's tests need nothing but the core beside it: no
algorithm plugin. The doubles are installed as a fake distribution, and subprocesses (the
``areal`` command line) see them through ``PYTHONPATH``; a module that runs simulations asks for it
(``pytestmark = pytest.mark.usefixtures("algorithm_double")``), and it is gone after that module."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def algorithm_double(tmp_path_factory):
    from areal_core.testing.rl_doubles import installed

    with installed(tmp_path_factory.mktemp("rl-doubles")) as (_, env):
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = before
