"""``areal plan``: the search finds what scoring every split finds, in fewer simulations; layouts the plugins'
validation refuses are never proposed; the command prints the allocation to use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from areal_core.testing import scaled
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
    """A plugin whose parallelism hook refuses odd server counts and a training tensor size of 4 (a real hook in a
    fake distribution): the plan skips them, and says so."""
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
            train = [c for c in allocation.components if c.backend == "sim_train"]
            if train and train[0].parallel.t == 4:
                return [Problem("evenservers.t4", "t4: this cluster's nodes pair GPUs", "t1 or t2",
                                key="allocation")]
            return []
    ''')
    curve = ThroughputCurveDouble(peak=5)  # the best split is refused: 4 or 6 must win
    with install_fake_distribution(tmp_path / "site", "areal-test-evenservers", "1.0",
                                   {"areal": {"evenservers": "evenservers_hooks"}}, {"evenservers_hooks.py": hook}):
        planner = Planner(_config(tmp_path), [], gpus=12, profile="qwen2.5-7b-h800", simulate=curve)
        every = planner.layouts
        # fewer train layouts than the plan's own (each is a validation): data, t2 and t4
        planner.layouts = lambda gpus: [tp for tp in every(gpus) if tp in ((1, 1), (2, 1), (4, 1))]
        result = planner.plan((2,), exhaustive=True)
    assert result.best.servers in (4, 6) and result.best.servers % 2 == 0
    assert all(c.servers % 2 == 0 and c.t != 4 for c in result.scored)
    assert {c.servers for c in result.refused if c.servers % 2} == {1, 3, 5, 7, 9, 11}
    # t4 where it divides the training GPUs: 8 of them, and 4
    assert {(c.servers, c.t) for c in result.refused if c.servers % 2 == 0} == {(4, 4), (8, 4)}
    assert all("this cluster pairs them" in c.refused or "t4: this cluster" in c.refused for c in result.refused)
    # refused layouts are not simulated: every train layout of the 5 accepted splits is, and nothing else
    accepted = [(s, t, p) for s in (2, 4, 6, 8, 10) for t, p in planner.layouts(12 - s) if t != 4]
    assert curve.calls == len(accepted) == len(result.scored)
    refused = sum(len(planner.layouts(12 - s)) for s in (1, 3, 5, 7, 9, 11)) + 2
    assert any(f"refused by the plugins' validation: {refused} layout(s)" in line for line in result.lines())


@pytest.mark.slow
@pytest.mark.parametrize("gpus, profile, overrides", [
    (12, "qwen2.5-1.5b-h800", []),
    (16, "qwen2.5-7b-h800", ["rollout.sampling.max_new_tokens=12000"]),
    (24, "qwen2.5-14b-h800", ["rollout.batch_size=24"]),
])
def test_the_plan_is_within_5_percent_of_the_best_of_the_exhaustive_grid(tmp_path, gpus, profile, overrides):
    """Three scenarios, real simulations: the searched plan against scoring every split at every eta."""
    config = _config(tmp_path)
    # each candidate until steady (the planner's default), as benchmarks/simulator.py --only plan: over 5 fixed steps
    # the landscape is the pipeline's filling (16 GPUs, 7B: 2 servers scored best), with peaks a search cannot see
    searched = Planner(config, overrides, gpus=gpus, profile=profile).plan((0, 2, 4))
    grid = Planner(config, overrides, gpus=gpus, profile=profile).plan((0, 2, 4), exhaustive=True)
    assert searched.best.samples_per_s >= 0.95 * grid.best.samples_per_s
    assert searched.simulations < grid.simulations


def test_areal_plan_prints_the_allocation_for_the_configs_own_backends(tmp_path):
    run = subprocess.run([sys.executable, "-m", "areal_cli.app", "plan", _config(tmp_path), "--gpus", "6",
                          "--profile", "qwen2.5-1.5b-h800", "--eta", "0,2", "--steps", "3"],
                         capture_output=True, text=True, timeout=scaled(600))
    assert run.returncode == 0, run.stderr
    first = run.stdout.splitlines()[0]
    assert first.startswith("allocation: sim:d") and "+sim_train:d" in first and "max_head_offpolicyness=" in first
    assert "runner-up:" in run.stdout


def test_areal_plan_names_a_bad_eta_list(tmp_path):
    run = subprocess.run([sys.executable, "-m", "areal_cli.app", "plan", _config(tmp_path), "--eta", "0,two"],
                         capture_output=True, text=True, timeout=scaled(120))
    assert run.returncode == 1 and "--eta '0,two': write whole numbers" in run.stderr


def _slow_link_profile(tmp_path, gbps: float):
    """qwen2.5-7b-h800 with a slower link between nodes: the gradient all-reduce of data parallelism costs more."""
    import yaml

    from areal_sim.profile import PROFILES

    data = yaml.safe_load((PROFILES / "qwen2.5-7b-h800.yaml").read_text())
    data["name"], data["train"]["allreduce_gbps"] = "slowlink", gbps
    path = tmp_path / "slowlink.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_the_train_layout_is_the_cost_models_fastest_that_the_validation_accepts(tmp_path):
    """Tensor parallelism wins where the gradient all-reduce between nodes dominates (a slow link, a small
    batch), data parallelism where the compute does; a layout a plugin refuses is never picked."""
    curve = ThroughputCurveDouble(peak=4)
    small = ["rollout.batch_size=2", "rollout.sampling.max_new_tokens=500"]
    slow = Planner(_config(tmp_path), small, gpus=16, profile=_slow_link_profile(tmp_path, 1.0), simulate=curve)
    slow.refusal = lambda candidate: None
    t, p = slow.layout(4, 2)  # 12 training GPUs
    assert t * p > 1 and slow.step_s(12, t, p) < slow.step_s(12, 1, 1)
    assert (t, p) == min(slow.layouts(12), key=lambda tp: slow.step_s(12, *tp))
    fast = Planner(_config(tmp_path), [], gpus=16, profile="qwen2.5-7b-h800", simulate=curve)
    fast.refusal = lambda candidate: None
    assert fast.layout(4, 2) == (1, 1)  # 16 x 4 x 3,000-token samples a step: the compute dominates
    # the plan simulates the split with that layout, and its allocation says so
    result = slow.plan((2,))
    assert (result.best.t, result.best.p) == slow.layout(result.best.servers, 2)
    assert result.best.allocation.endswith(f"t{result.best.t}" if result.best.p == 1 else f"p{result.best.p}")
    assert "training as d" in result.lines()[1]
    # a validation that refuses tensor sizes above 2: the pick is the fastest of the rest
    picky = Planner(_config(tmp_path), small, gpus=16, profile=_slow_link_profile(tmp_path, 1.0), simulate=curve)
    picky.refusal = lambda c: "t above 2" if c.t > 2 else None
    t, p = picky.layout(4, 2)
    assert t <= 2 and (t, p) == min([tp for tp in picky.layouts(12) if tp[0] <= 2],
                                    key=lambda tp: picky.step_s(12, *tp))


def test_a_profile_without_the_models_shape_keeps_the_train_layout_data_parallel(tmp_path):
    planner = Planner(_config(tmp_path), [], gpus=4, profile="smollm2-135m-cpu", simulate=ThroughputCurveDouble(1))
    assert planner.layouts(2) == [(1, 1)]


def test_each_candidate_runs_until_its_figure_is_steady(tmp_path):
    """By default a candidate's simulation stops once steady (sim.steady_tolerance, 2 %) within 60 steps; with
    tolerance 0 it runs the steps it is given."""
    seen = []

    def recording(overrides):
        seen.append(dict(o.split("=", 1) for o in overrides))
        return {"steady_samples_per_s": 1.0}

    Planner(_config(tmp_path), [], gpus=8, profile="qwen2.5-7b-h800", simulate=recording).score(4, 2)
    assert (seen[-1]["sim.steady_tolerance"], seen[-1]["trainer.total_steps"]) == ("0.02", "60")
    Planner(_config(tmp_path), [], gpus=8, profile="qwen2.5-7b-h800", steps=6, tolerance=0,
            simulate=recording).score(4, 2)
    assert (seen[-1]["sim.steady_tolerance"], seen[-1]["trainer.total_steps"]) == ("0", "6")
