"""Shared fixtures: fake installed distributions for plugin-system tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_core.testing.distributions import install_fake_distribution

DOUBLES = Path(__file__).parent / "doubles"
# Test doubles are imported by name in tests (they are never shipped).
sys.path.insert(0, str(DOUBLES))

STACK_ENTRY_POINTS = {
    "areal": {"stack-doubles": "stack_doubles"},
    "areal.engines.train": {"train_double": "stack_doubles:TrainEngineDouble"},
    "areal.engines.inference": {"infer_double": "stack_doubles:InferenceEngineDouble"},
    "areal.algorithms": {"algo_double": "stack_doubles:AlgorithmDouble"},
    "areal.workflows": {"workflow_double": "stack_doubles:WorkflowDouble"},
    "areal.rewards": {"reward_double": "stack_doubles:reward_double"},
    "areal.datasets": {"dataset_double": "stack_doubles:DatasetDouble"},
    "areal.launchers": {"launcher_double": "stack_doubles:LauncherDouble"},
}

# Overrides that select the doubles for every component of a run.
STACK_OVERRIDES = [
    "actor.backend=train_double",
    "rollout.backend=infer_double",
    "algorithm.name=algo_double",
    "workflow.name=workflow_double",
    "reward.name=reward_double",
    "dataset.name=dataset_double",
    "launcher.name=launcher_double",
]


@pytest.fixture
def double_stack(tmp_path):
    """One fake distribution providing a test double of every component kind.

    Yields the overrides that select them all."""
    source = (DOUBLES / "stack_doubles.py").read_text()
    with install_fake_distribution(
        tmp_path / "stack", "areal-test-doubles", "9.9.9", STACK_ENTRY_POINTS, {"stack_doubles.py": source}
    ):
        yield list(STACK_OVERRIDES)


@pytest.fixture
def rl_doubles_env(tmp_path):
    """The RL doubles (:mod:`areal_core.testing.rl_doubles`) installed as a fake distribution, for `areal run`
    in a subprocess: yields (the doubles' config file, the environment that finds them)."""
    from areal_core.testing import rl_doubles

    with rl_doubles.installed(tmp_path) as (config, env):
        yield config, env


@pytest.fixture(autouse=True)
def fresh_plugin_manager():
    """Each test sees the plugins installed at that moment, not a cached view."""
    import areal_core.plugins

    areal_core.plugins._cached = None
    yield
    areal_core.plugins._cached = None
