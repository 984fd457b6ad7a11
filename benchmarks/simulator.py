"""The simulator's validation figures (issue 24): the AReaL paper's shape at scale, and the simulator's own cost.

    python benchmarks/simulator.py --write               # every experiment; the tables into benchmarks/simulator.md
    python benchmarks/simulator.py --only scaling,eta    # some of them (tables to stdout)
    python benchmarks/simulator.py --only perf --steps 100 --workers 1   # the simulator's own speed at 512 GPUs

Experiments (``examples/sim_areal_paper.yaml``: 512 prompts x 16 answers a step, eta 4, 3:1 inference:training,
the H800 profiles of ``areal_sim/profiles``; each point a real ``areal simulate`` in a process of its own):

- ``scaling``: synchronous (eta 0, on the split of the GPUs and colocated on all of them, ``sim.colocate``) and
  asynchronous (eta 4) samples/s at 32 to 512 GPUs (1.5B): the async/sync speedups at each size, and strong
  scaling (throughput against 8x the 64-GPU point's, "% of linear");
- ``weak``: asynchronous samples/s at 64 to 512 GPUs with the batch growing with the GPUs (64 groups at 64 GPUs,
  512 at 512: the same work per GPU), against 512/64 x the 64-GPU point ("% of linear");
- ``length``: the same speedup at 64 GPUs as the response-length cap grows (4k to 32k tokens, 7B);
- ``eta``: samples/s and the share of trained tokens at each staleness for eta 0, 1, 2, 4, 8 and unbounded
  (64 GPUs, 7B; pacing off so that the bound is what limits, and 1,024 groups in flight at most, which is what
  "unbounded" (eta 1000) is then held to);
- ``interrupt``: interruptible generation against drain-on-update (the engine cannot pause, so an update waits for
  the requests in flight) at eta 4 (64 GPUs, 1.5B and 7B);
- ``stepcpu``: the 512-GPU points of ``scaling`` (1.5B, sync split and async) with the serving engine's CPU time
  per decode step at 0, 2 (the profiles' assumption) and 5 ms (``sim.step_cpu_ms``): how much the result rests on it;
- ``perf``: wall time of ``--steps`` steps at 512 GPUs (1.5B), and the wall ms per episode;
- ``plan``: ``areal plan``'s search against scoring every split at eta 0, 2, 4, on the three scenarios of
  ``plugins/engines/sim/tests/test_plan.py`` (its small config), with the simulations each needed;
- ``horizon``: what ``areal plan`` picks on 32 GPUs (7B, 64 x 8 a step, 16k cap, eta 0-8) when each candidate runs
  a fixed 6 steps (the planner before), until steady (now), or a fixed 60 steps, each pick scored again at 60.

Each point runs until its figure is steady (``sim.steady_tolerance=0.02``, at most ``--steps``; perf: exactly
``--steps``), and its samples/s is the report's ``steady_samples_per_s``: trajectories a second over the second half
of the steps (the first ones fill the pipeline). Results go to ``--out`` (JSON; a re-run finishes what an earlier one
left) and the tables to stdout (markdown); ``--write`` puts them into ``benchmarks/simulator.md`` between its
``<!-- simulator.py: NAME -->`` and ``<!-- /simulator.py -->`` lines, which a test checks against a re-run of the
smallest points (``tests/test_published_figures.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples" / "sim_areal_paper.yaml")


HORIZON = ["rollout.batch_size=64", "rollout.group_size=8", "rollout.sampling.max_new_tokens=16384"]
HORIZONS = {"fixed6": (6, 0.0), "steady": (60, 0.02), "fixed60": (60, 0.0)}  # (most steps, tolerance)
STEADY = 0.02
DOC = ROOT / "benchmarks" / "simulator.md"
PLAN_SCENARIOS = [(12, "qwen2.5-1.5b-h800", []), (16, "qwen2.5-7b-h800", ["rollout.sampling.max_new_tokens=12000"]),
                  (24, "qwen2.5-14b-h800", ["rollout.batch_size=24"])]
PLAN_CONFIG = ROOT / "plugins" / "engines" / "sim" / "tests" / "test_plan.py"


def plan_point(args: list[str]) -> dict:
    """One planner scenario: the search and the exhaustive grid, on the planner tests' config."""
    import importlib.util
    import tempfile

    from areal_sim.plan import Planner

    spec = importlib.util.spec_from_file_location("test_plan", PLAN_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gpus, profile, extra = int(args[0]), args[1], args[2:]
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder, "config.yaml")
        config.write_text(module.CONFIG.replace("rl_pg_double", "grpo"))  # the tests' algorithm double -> GRPO
        searched = Planner(str(config), extra, gpus=gpus, profile=profile).plan((0, 2, 4))
        grid = Planner(str(config), extra, gpus=gpus, profile=profile).plan((0, 2, 4), exhaustive=True)
    return {"searched": searched.best.allocation, "searched_eta": searched.best.eta,
            "searched_samples_per_s": searched.best.samples_per_s, "searched_simulations": searched.simulations,
            "grid": grid.best.allocation, "grid_eta": grid.best.eta, "grid_samples_per_s": grid.best.samples_per_s,
            "grid_simulations": grid.simulations, "steady_samples_per_s": searched.best.samples_per_s,
            "wall_s": 0.0}


def horizon_point(args: list[str]) -> dict:
    """``areal plan`` on the 32-GPU scenario with one horizon; its pick scored again with 60 fixed steps."""
    from areal_sim.plan import Planner

    steps, tolerance = HORIZONS[args[0]]
    planner = Planner(CONFIG, HORIZON, gpus=32, profile="qwen2.5-7b-h800", steps=steps, tolerance=tolerance)
    best = planner.plan((0, 1, 2, 4, 8)).best
    long = Planner(CONFIG, HORIZON, gpus=32, profile="qwen2.5-7b-h800", steps=60, tolerance=0.0)
    again = long.score(best.servers, best.eta, best.t, best.p)
    return {"pick": best.allocation, "eta": best.eta, "predicted": best.samples_per_s,
            "at_60_steps": again.samples_per_s, "simulations": planner.simulations,
            "steady_samples_per_s": again.samples_per_s, "wall_s": 0.0}


def simulate(overrides: list[str]) -> dict:
    """One point, in this process (its report)."""
    import tempfile

    from areal_sim.simulate import run_simulation

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        report = run_simulation(CONFIG, overrides, folder)
    report["overrides"] = overrides
    return report


SYNC = {"eta0": ["rollout.max_head_offpolicyness=0"], "colo": ["rollout.max_head_offpolicyness=0", "sim.colocate=true"],
        "eta4": ["rollout.max_head_offpolicyness=4"]}


def points(name: str, steps: int) -> list[tuple[str, list[str]]]:
    base = [f"trainer.total_steps={steps}", f"sim.steady_tolerance={STEADY}"]
    if name == "scaling":
        return [(f"scaling/{gpus}/{mode}", base + [f"sim.gpus={gpus}", "sim.profile=qwen2.5-1.5b-h800", *SYNC[mode]])
                for gpus in (32, 64, 128, 256, 512) for mode in SYNC]
    if name == "weak":
        return [(f"weak/{gpus}", base + [f"sim.gpus={gpus}", "sim.profile=qwen2.5-1.5b-h800",
                                         f"rollout.batch_size={gpus}", f"rollout.max_concurrent_rollouts={8 * gpus}"])
                for gpus in (64, 128, 256, 512)]
    if name == "length":
        return [(f"length/{cap}/{mode}", base + ["sim.gpus=64", "sim.profile=qwen2.5-7b-h800",
                                                 f"rollout.sampling.max_new_tokens={cap}", *SYNC[mode]])
                for cap in (4096, 8192, 16384, 32768) for mode in SYNC]
    if name == "eta":
        return [(f"eta/{eta}", base + ["sim.gpus=64", "sim.profile=qwen2.5-7b-h800",
                                        f"rollout.max_head_offpolicyness={eta}",
                                        "rollout.max_concurrent_rollouts=1024", "rollout.pacing=false"])
                for eta in (0, 1, 2, 4, 8, 1000)]
    if name == "interrupt":
        return [(f"interrupt/{size}/{mode}", base + ["sim.gpus=64", f"sim.profile=qwen2.5-{size}-h800",
                                                      f"rollout.interruptible={mode == 'interruptible'}"])
                for size in ("1.5b", "7b") for mode in ("interruptible", "drain")]
    if name == "plan":
        return [(f"plan/{gpus}/{profile}", [str(gpus), profile, *extra]) for gpus, profile, extra in PLAN_SCENARIOS]
    if name == "horizon":
        return [(f"horizon/{h}", [h]) for h in HORIZONS]
    if name == "stepcpu":
        return [(f"stepcpu/{ms}/{mode}", base + ["sim.gpus=512", "sim.profile=qwen2.5-1.5b-h800", f"sim.step_cpu_ms={ms}",
                                                *SYNC[mode]]) for ms in (0, 2, 5) for mode in ("eta0", "eta4")]
    if name == "perf":
        return [("perf/512", [f"trainer.total_steps={steps}", "sim.gpus=512", "sim.profile=qwen2.5-1.5b-h800"])]
    raise SystemExit(f"--only: unknown experiment {name!r}; one of {', '.join(EXPERIMENTS)}, perf")


EXPERIMENTS = ("scaling", "weak", "length", "eta", "interrupt", "plan", "horizon", "stepcpu")


def _rate(r: dict) -> float:
    return r["steady_samples_per_s"]


def _steps(group: dict[str, dict]) -> str:
    """The steps the points of a table ran (each until steady, at most --steps)."""
    steps = sorted(r["steps"] for r in group.values() if "steps" in r)
    return f"{steps[0]}-{steps[-1]}" if steps and steps[0] != steps[-1] else str(steps[0]) if steps else "-"


def scaling_row(gpus: int, scaling: dict[str, dict]) -> str | None:
    """One row of the scaling table (what the published-figures test re-runs for the smallest size)."""
    s, c, a = (scaling.get(f"scaling/{gpus}/{mode}") for mode in SYNC)
    if not (s and c and a):
        return None
    base = scaling.get("scaling/64/eta4")
    linear = f"{_rate(a) / (_rate(base) * gpus / 64):.0%}" if base else "-"
    return (f"| {gpus} | {_rate(s):.1f} | {_rate(c):.1f} | {_rate(a):.1f} | {_rate(a) / _rate(s):.2f}x | "
            f"{_rate(a) / _rate(c):.2f}x | {linear} | {s['utilisation']['inference']:.0%} / "
            f"{a['utilisation']['inference']:.0%} |")


def tables(results: dict[str, dict]) -> dict[str, str]:
    """Each experiment's table (markdown), by experiment, for what ``results`` holds."""
    out: dict[str, str] = {}
    scaling = {k: v for k, v in results.items() if k.startswith("scaling/")}
    if scaling:
        rows = [scaling_row(gpus, scaling) for gpus in (32, 64, 128, 256, 512)]
        out["scaling"] = "\n".join([
            "| GPUs | sync (split) samples/s | sync (colocated) samples/s | async samples/s | async / sync split | "
            "async / sync colocated | async % of linear (from 64) | inference util. sync split / async |",
            "|---|---|---|---|---|---|---|---|", *(r for r in rows if r),
            "", f"Steps simulated per point: {_steps(scaling)}."])
    weak = {k: v for k, v in results.items() if k.startswith("weak/")}
    if weak and "weak/64" in weak:
        lines = ["| GPUs | batch (groups) | async samples/s | % of linear (from 64) | inference / train util. |",
                 "|---|---|---|---|---|"]
        base = _rate(weak["weak/64"])
        for gpus in (64, 128, 256, 512):
            r = weak.get(f"weak/{gpus}")
            if r:
                lines.append(f"| {gpus} | {r['batch_size']} | {_rate(r):.1f} | {_rate(r) / (base * gpus / 64):.0%} | "
                             f"{r['utilisation']['inference']:.0%} / {r['utilisation']['train']:.0%} |")
        out["weak"] = "\n".join(lines + ["", f"Steps simulated per point: {_steps(weak)}."])
    length = {k: v for k, v in results.items() if k.startswith("length/")}
    if length:
        lines = ["| length cap | mean length | sync (split) samples/s | sync (colocated) samples/s | async samples/s | "
                 "async / sync split | async / sync colocated |", "|---|---|---|---|---|---|---|"]
        for cap in (4096, 8192, 16384, 32768):
            s, c, a = (length.get(f"length/{cap}/{mode}") for mode in SYNC)
            if s and c and a:
                mean = a["generated_tokens_per_s"] / max(a["samples_per_s"], 1e-9)
                lines.append(f"| {cap} | {mean:.0f} | {_rate(s):.2f} | {_rate(c):.2f} | {_rate(a):.2f} | "
                             f"{_rate(a) / _rate(s):.2f}x | {_rate(a) / _rate(c):.2f}x |")
        out["length"] = "\n".join(lines + ["", f"Steps simulated per point: {_steps(length)}."])
    eta = {k: v for k, v in results.items() if k.startswith("eta/")}
    if eta:
        lines = ["| eta | samples/s | vs eta 0 | trained tokens at staleness 0 / 1 / 2 / 3+ | steps |",
                 "|---|---|---|---|---|"]
        zero = eta.get("eta/0")
        for k in (0, 1, 2, 4, 8, 1000):
            r = eta.get(f"eta/{k}")
            if not r:
                continue
            lags = {int(lag): share for lag, share in r["staleness_tokens_by_lag"].items()}
            shares = [lags.get(0, 0.0), lags.get(1, 0.0), lags.get(2, 0.0), sum(v for g, v in lags.items() if g >= 3)]
            ratio = f"{_rate(r) / _rate(zero):.2f}x" if zero else "-"
            lines.append(f"| {'unbounded' if k == 1000 else k} | {_rate(r):.2f} | {ratio} | "
                         + " / ".join(f"{v:.0%}" for v in shares) + f" | {r['steps']} |")
        out["eta"] = "\n".join(lines)
    inter = {k: v for k, v in results.items() if k.startswith("interrupt/")}
    if inter:
        lines = ["| model | drain-on-update samples/s | interruptible samples/s | gain |", "|---|---|---|---|"]
        for size in ("1.5b", "7b"):
            d, i = inter.get(f"interrupt/{size}/drain"), inter.get(f"interrupt/{size}/interruptible")
            if d and i:
                lines.append(f"| {size} | {_rate(d):.2f} | {_rate(i):.2f} | {_rate(i) / _rate(d) - 1:+.0%} |")
        out["interrupt"] = "\n".join(lines + ["", f"Steps simulated per point: {_steps(inter)}."])
    plans = {k: v for k, v in results.items() if k.startswith("plan/")}
    if plans:
        lines = ["| scenario | planned (search) | best of the grid | planned / best | simulations: search / grid |",
                 "|---|---|---|---|---|"]
        for key, r in plans.items():
            lines.append(f"| {key[5:]} | {r['searched']} eta {r['searched_eta']} | {r['grid']} eta {r['grid_eta']} | "
                         f"{r['searched_samples_per_s'] / r['grid_samples_per_s']:.1%} | "
                         f"{r['searched_simulations']} / {r['grid_simulations']} |")
        out["plan"] = "\n".join(lines)
    horizons = {k: v for k, v in results.items() if k.startswith("horizon/")}
    if horizons:
        lines = ["| each candidate runs | plan | predicted samples/s | its samples/s at 60 steps | simulations |",
                 "|---|---|---|---|---|"]
        names = {"fixed6": "6 steps (before)", "steady": "until steady, at most 60 (now)", "fixed60": "60 steps"}
        for h in HORIZONS:
            r = horizons.get(f"horizon/{h}")
            if r:
                lines.append(f"| {names[h]} | {r['pick']} eta {r['eta']} | {r['predicted']:.2f} | "
                             f"{r['at_60_steps']:.2f} | {r['simulations']} |")
        out["horizon"] = "\n".join(lines)
    steps_cpu = {k: v for k, v in results.items() if k.startswith("stepcpu/")}
    if steps_cpu:
        lines = ["| CPU per decode step | sync (split) samples/s | async samples/s | async / sync |", "|---|---|---|---|"]
        for ms in (0, 2, 5):
            s_, a = steps_cpu.get(f"stepcpu/{ms}/eta0"), steps_cpu.get(f"stepcpu/{ms}/eta4")
            if s_ and a:
                lines.append(f"| {ms} ms | {_rate(s_):.1f} | {_rate(a):.1f} | {_rate(a) / _rate(s_):.2f}x |")
        out["stepcpu"] = "\n".join(lines + ["", f"Steps simulated per point: {_steps(steps_cpu)}."])
    perf = results.get("perf/512")
    if perf:
        out["perf"] = (f"512 GPUs, {perf['steps']} steps: {perf['wall_s']:.0f} s of wall time for "
                       f"{perf['simulated_s']:.0f} simulated s; {perf['episodes']} episodes, {perf['engine_calls']} "
                       f"engine calls, {perf['wall_ms_per_episode']:.1f} ms an episode")
    return out


def write_doc(blocks: dict[str, str], path: Path = DOC) -> list[str]:
    """Each block into ``path`` between its ``<!-- simulator.py: NAME -->`` and the next ``<!-- /simulator.py -->``
    line; the names written. A block the file has no place for is an error (the doc names every table it shows)."""
    text = path.read_text()
    written = []
    for name, block in blocks.items():
        opening = f"<!-- simulator.py: {name} -->\n"
        at = text.find(opening)
        if at < 0:
            raise SystemExit(f"--write: {path} has no '<!-- simulator.py: {name} -->' line for the {name} table")
        begin = at + len(opening)
        end = text.index("<!-- /simulator.py -->", begin)
        text = text[:begin] + block + "\n" + text[end:]
        written.append(name)
    path.write_text(text)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(EXPERIMENTS))
    parser.add_argument("--steps", type=int, default=60, help="the most steps a point runs (perf: exactly)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="simulator.json")
    parser.add_argument("--write", action="store_true", help=f"put the tables into {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    todo = [p for name in args.only.split(",") for p in points(name, args.steps)]
    results: dict[str, dict] = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    todo = [(k, o) for k, o in todo if k not in results]  # a re-run finishes what an earlier one left
    began = time.perf_counter()
    runners = {"plan/": plan_point, "horizon/": horizon_point}
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {key: pool.submit(next((f for prefix, f in runners.items() if key.startswith(prefix)), simulate),
                                    overrides) for key, overrides in todo}
        for key, future in futures.items():
            results[key] = future.result()
            Path(args.out).write_text(json.dumps(results, indent=1))
            print(f"{key}: {_rate(results[key]):.2f} samples/s ({results[key]['wall_s']:.0f} s wall, "
                  f"{time.perf_counter() - began:.0f} s in)", file=sys.stderr, flush=True)
    blocks = tables(results)
    for name, block in blocks.items():
        print(f"{name}:\n{block}\n")
    if args.write:
        print(f"written into {DOC}: {', '.join(write_doc(blocks))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
