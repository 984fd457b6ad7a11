"""The learning study's pipeline (benchmarks/learning.py): its statistics checked against independent figures, and
(slow suite) its small version end to end: real `areal run`s, the results file, the report and the plots."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.testing import scaled

ROOT = Path(__file__).resolve().parents[1]


def _study():
    spec = importlib.util.spec_from_file_location("learning_study", ROOT / "benchmarks" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_interval_is_students_t_over_the_seeds():
    study = _study()
    # 0.5, 0.6, 0.7: mean 0.6, sample sd 0.1, t(0.975, 2) = 4.303 -> half-width 4.303 * 0.1 / sqrt(3)
    mean, half = study.interval95([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and half == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
    assert study.interval95([0.4]) == (0.4, 0.0)
    # large samples: the normal's 1.96
    values = [0.0, 1.0] * 40
    assert study.interval95(values)[1] == pytest.approx(1.96 * 0.5031546 / 80 ** 0.5, rel=1e-4)


def _run(task, eta, objective, seed, final, curve_accuracies, lags):
    curve = [{"step": 10 * i, "samples": 160 * i, "wall_s": 30.0 * i, "accuracy": a}
             for i, a in enumerate(curve_accuracies)]
    curve[-1]["accuracy"] = final
    return {"task": task, "eta": eta, "objective": objective, "seed": seed, "steps": 10 * (len(curve) - 1),
            "samples": 160 * (len(curve) - 1), "wall_s": 100.0, "final_accuracy": final, "curve": curve,
            "staleness": lags}


def test_the_summary_takes_the_target_from_eta_0_and_states_the_checks():
    study = _study()
    runs = [_run("t", 0, "decoupled", s, f, [0.2, 0.5, 0.7], {"0": 1.0}) for s, f in ((1, 0.7), (2, 0.8))]
    runs += [_run("t", 4, "decoupled", s, f, [0.2, 0.6, 0.7], {"0": 0.5, "4": 0.5})
             for s, f in ((1, 0.72), (2, 0.74), (3, 0.76))]
    runs += [_run("t", 4, "naive", s, f, [0.2, 0.3, 0.4], {"0": 0.5, "4": 0.5})
             for s, f in ((1, 0.40), (2, 0.42), (3, 0.44))]
    summary = study.summarise(runs)
    zero = summary["cells"]["t/eta0/decoupled"]
    assert zero["final_mean"] == pytest.approx(0.75) and zero["target"] == pytest.approx(0.675)
    # eta 0 reaches 0.675 at its last point (0.7 / 0.8), i.e. 320 samples, 60 s
    assert (zero["reached"], zero["samples_to_target"], zero["wall_to_target_s"]) == ("2/2", 320, 60.0)
    naive = summary["cells"]["t/eta4/naive"]
    assert naive["reached"] == "0/3" and naive["samples_to_target"] is None
    assert summary["cells"]["t/eta4/decoupled"]["staleness"] == {"0": 0.5, "4": 0.5}
    checks = {c["claim"]: c for c in summary["checks"]}
    within = checks["eta 4 (decoupled) within eta 0's 95 % interval at equal samples"]
    assert within["holds"]  # 0.74 inside 0.75 +- 12.706 * 0.0707 / 1.414
    versus = checks["decoupled above naive PPO at eta 4"]
    # 0.32 apart, each side +- 4.303 * 0.02 / sqrt(3): the difference's interval is clear of 0
    assert versus["difference"] == pytest.approx(0.32) and versus["holds"] and not versus["null"]
    assert versus["difference_half"] == pytest.approx(2 ** 0.5 * 4.303 * 0.02 / 3 ** 0.5)
    # a gap inside the interval is stated as no difference either way
    close = [dict(r, final_accuracy=r["final_accuracy"] + 0.3) if r["objective"] == "naive" else r for r in runs]
    versus = {c["claim"]: c for c in study.summarise(close)["checks"]}["decoupled above naive PPO at eta 4"]
    assert not versus["holds"] and versus["null"]


def test_the_grid_runs_the_headline_cells_first_and_skips_naive_ppo_at_eta_0():
    study = _study()
    cells = study.grid(["addition"], (0, 1, 4), seeds=3, headline_seeds=5)
    assert [(c.eta, c.objective) for c in cells[:10]] == [(0, "decoupled"), (4, "decoupled")] * 5
    assert not any(c.eta == 0 and c.objective == "naive" for c in cells)
    assert len(cells) == 5 + 5 + 3 + 3 + 3  # eta 0, eta 4 decoupled; eta 1 both, eta 4 naive


@pytest.mark.slow
def test_the_small_study_runs_end_to_end_and_resumes(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "learning.py"), "--small", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=scaled(1500))
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results["runs"]) == [f"addition-eta{e}-decoupled-s{s}" for e in (0, 4) for s in (1, 2)]
    for record in results["runs"].values():
        assert [p["step"] for p in record["curve"]] == [0, 2, 4] and record["samples"] == 64
        assert 0.0 <= record["final_accuracy"] <= 1.0 and record["final_accuracy"] == record["curve"][-1]["accuracy"]
        if record["eta"] == 0:
            assert record["staleness"] == {"0": 1.0}  # synchronous: nothing stale
    eta4 = [r for r in results["runs"].values() if r["eta"] == 4]
    assert all(max(int(lag) for lag in r["staleness"]) <= 4 for r in eta4)
    report = (tmp_path / "learning.md").read_text()
    assert "| addition | 0 | decoupled | 2 |" in report and "eta 4 (decoupled) within eta 0's 95 % interval" in report
    assert (tmp_path / "learning-addition.png").stat().st_size > 10_000
    # everything recorded: a second invocation runs nothing and gives the same report
    again = subprocess.run(command, capture_output=True, text=True, timeout=scaled(120))
    assert again.returncode == 0 and "final accuracy" not in again.stderr, again.stderr
    assert (tmp_path / "learning.md").read_text() == report
