"""What SGLangEngine refuses once its servers are up (an interpreter without SGLang, a release outside the
supported range), `areal check` refuses too, and `areal run` refuses before it starts anything (issue 40,
point 6). The core's RL doubles stand in for the trainer; the interpreters are stand-ins (a script running this
Python with a stand-in `sglang` distribution on its path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_core.testing import rl_doubles
from areal_core.testing.distributions import interpreter_with
from areal_sglang.engine import SUPPORTED, check_version


def areal(command: str, folder: Path, *overrides: str):
    return rl_doubles.areal_command(command, folder, ["allocation=sglang:d1+rl_train_double:cpu", "rollout.backend=sglang",
                                                      *overrides])


@pytest.mark.parametrize("case", ["without-sglang", "old-release"])
def test_check_run_and_the_engine_refuse_the_servers_interpreter_alike(tmp_path, case):
    python = Path(sys.executable) if case == "without-sglang" else interpreter_with(tmp_path / "old", "sglang", "0.4.9")
    says = "has no sglang package" if case == "without-sglang" else "has sglang 0.4.9; the sglang plugin supports"
    check = areal("check", tmp_path, f"rollout.python={python}")
    assert check.returncode == 1 and "[sglang.python]" in check.stdout and says in check.stdout, check.stdout
    assert "Traceback" not in check.stdout
    run = areal("run", tmp_path, f"rollout.python={python}")
    assert run.returncode == 1 and "[sglang.python]" in run.stdout, run.stdout
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made: no server started
    if case == "old-release":
        assert SUPPORTED in check.stdout
        with pytest.raises(RuntimeError, match=r"reports version '0.4.9'"):
            check_version("0.4.9")


def test_a_supported_release_passes_the_check(tmp_path):
    good = interpreter_with(tmp_path / "good", "sglang", "0.5.4")
    check = areal("check", tmp_path, f"rollout.python={good}")
    assert check.returncode == 0, check.stdout
