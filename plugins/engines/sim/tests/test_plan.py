"""``areal plan``: the search finds what scoring every split finds, in fewer simulations; layouts the plugins'
validation refuses are never proposed; the command prints the allocation to use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from areal_sim.plan import Planner

pytestmark = pytest.mark.usefixtures("algorithm_double")  # tests/conftest.py: the core's algorithm double

CONFIG = """\
experiment: plantest
trial: t
allocation: "sim:d4+sim_train:d4"
rollout: {backend: sim, batch_size: 16, group_size: 4, max_head_offpolicyness: 2, max_concurrent_rollouts: 64,
          weight_sync: tensors, sampling: {max_new_tokens: 6000}}
actor: {backend: sim_train}
algorithm: {name: rl_pg_double}
workflow: {name: sim}
reward: {name: sim}
dataset: {name: sim}
eval: {size: 0, before: false}
"""


def _config(tmp_path, text=CONFIG):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


class ThroughputCurveDouble:
    """Stands in for the simulation in the search tests: a known throughput with one peak in the servers, higher
    for larger eta, and a count of the calls."""

    def __init__(self, peak: int):
        self.peak, self.calls = peak, 0

    def __call__(self, overrides):
        self.calls += 1
        values = dict(o.split("=", 1) for o in overrides)
        servers = int(values["sim.inference_gpus"])
        eta = int(values["rollout.max_head_offpolicyness"])
        return {"steady_samples_per_s": (100 - (servers - self.peak) ** 2 / 4) * (1 + 0.1 * min(eta, 3))}


@pytest.mark.parametrize("gpus, peak", [(64, 40), (64, 3), (48, 46), (100, 70)])
def test_the_search_finds_the_peak_with_far_fewer_simulations_than_every_split(tmp_path, gpus, peak):
    curve = ThroughputCurveDouble(peak)
    planner = Planner(_config(tmp_path), [], gpus=gpus, profile="qwen2.5-7b-h800", simulate=curve)
    planner.refusal = lambda candidate: None  # the search alone (validation has its own test)
    result = planner.plan((0, 2, 4))
    assert (result.best.servers, result.best.eta) == (peak, 4)
    assert result.runner_up is not None and result.runner_up.samples_per_s <= result.best.samples_per_s
    assert curve.calls < 0.5 * 3 * (gpus - 1)


def test_layouts_the_validation_refuses_are_never_proposed(tmp_path):
    """A plugin whose parallelism hook refuses odd server counts (a real hook in a fake distribution): the plan
    skips them, and says so."""
    from areal_core.testing.distributions import install_fake_distribution

    hook = textwrap.dedent('''
        from areal_core import hookimpl
        from areal_core.problems import Problem

        @hookimpl
        def areal_validate_parallelism(config, allocation, model, backends):
            servers = [c for c in allocation.components if c.backend == "sim"]
            if servers and servers[0].parallel.d % 2:
                return [Problem("evenservers.odd", f"{servers[0].parallel.d} servers: this cluster pairs them",
                                "an even count", key="allocation")]
            return []
    ''')
    curve = ThroughputCurveDouble(peak=5)  # the best split is refused: 4 or 6 must win
    with install_fake_distribution(tmp_path / "site", "areal-test-evenservers", "1.0",
                                   {"areal": {"evenservers": "evenservers_hooks"}}, {"evenservers_hooks.py": hook}):
        planner = Planner(_config(tmp_path), [], gpus=12, profile="qwen2.5-7b-h800", simulate=curve)
        result = planner.plan((2,), exhaustive=True)
    assert result.best.servers in (4, 6) and result.best.servers % 2 == 0
    assert all(c.servers % 2 == 0 for c in result.scored)
    assert {c.servers for c in result.refused} == {1, 3, 5, 7, 9, 11}
    assert all("this cluster pairs them" in c.refused for c in result.refused)
    assert curve.calls == 5  # refused layouts are not simulated
    assert any("refused by the plugins' validation: 6 layout(s)" in line for line in result.lines())


@pytest.mark.slow
@pytest.mark.parametrize("gpus, profile, overrides", [
    (12, "qwen2.5-1.5b-h800", []),
    (16, "qwen2.5-7b-h800", ["rollout.sampling.max_new_tokens=12000"]),
    (24, "qwen2.5-14b-h800", ["rollout.batch_size=24"]),
])
def test_the_plan_is_within_5_percent_of_the_best_of_the_exhaustive_grid(tmp_path, gpus, profile, overrides):
    """Three scenarios, real simulations: the searched plan against scoring every split at every eta."""
    config = _config(tmp_path)
    searched = Planner(config, overrides, gpus=gpus, profile=profile, steps=5).plan((0, 2, 4))
    grid = Planner(config, overrides, gpus=gpus, profile=profile, steps=5).plan((0, 2, 4), exhaustive=True)
    assert searched.best.samples_per_s >= 0.95 * grid.best.samples_per_s
    assert searched.simulations < grid.simulations


def test_areal_plan_prints_the_allocation_for_the_configs_own_backends(tmp_path):
    run = subprocess.run([sys.executable, "-m", "areal_cli.app", "plan", _config(tmp_path), "--gpus", "6",
                          "--profile", "qwen2.5-1.5b-h800", "--eta", "0,2", "--steps", "3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    first = run.stdout.splitlines()[0]
    assert first.startswith("allocation: sim:d") and "+sim_train:d" in first and "max_head_offpolicyness=" in first
    assert "runner-up:" in run.stdout


def test_areal_plan_names_a_bad_eta_list(tmp_path):
    run = subprocess.run([sys.executable, "-m", "areal_cli.app", "plan", _config(tmp_path), "--eta", "0,two"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "--eta '0,two': write whole numbers" in run.stderr
