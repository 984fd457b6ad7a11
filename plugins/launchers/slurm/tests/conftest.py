"""Fixtures: the SLURM stand-ins first on PATH, and `areal run` with the core's RL doubles plus this plugin's
served doubles installed.

The stand-ins (``slurm_standins/standin_*.py``) are NOT SLURM: they run a job on this machine, every pretend
node being this machine. See README.md for what they cover.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # slurm_helpers.py and served_doubles.py, beside this file
from slurm_helpers import COMMANDS, HERE, STANDINS, StandIns  # noqa: E402


@pytest.fixture
def standins(tmp_path) -> StandIns:
    """sbatch, srun, scancel and squeue stand-ins: wrappers running ``slurm_standins/standin_<name>.py`` with
    this interpreter (stdlib only), in a folder the tests put first on PATH."""
    bin_dir, state = tmp_path / "slurm-standin-bin", tmp_path / "slurm-standin-state"
    bin_dir.mkdir()
    state.mkdir()
    for name in COMMANDS:
        wrapper = bin_dir / name
        wrapper.write_text(f'#!/bin/sh\n# stand-in for SLURM\'s {name} (tests only)\n'
                           f'exec "{sys.executable}" "{STANDINS / f"standin_{name}.py"}" "$@"\n')
        wrapper.chmod(0o755)
    return StandIns(bin_dir, state)


@pytest.fixture
def doubles(tmp_path):
    """The core's RL doubles and this plugin's served doubles, installed in one folder: yields (the doubles'
    config file, the environment in which `areal run` and every process of its job find them)."""
    from areal_core.testing import rl_doubles
    from areal_core.testing.distributions import install_fake_distribution

    import served_doubles

    with rl_doubles.installed(tmp_path) as (config, env):
        with install_fake_distribution(tmp_path / "site", "areal-test-slurm-doubles", "0.0.1",
                                       served_doubles.ENTRY_POINTS,
                                       {"served_doubles.py": (HERE / "served_doubles.py").read_text()}):
            yield config, env
