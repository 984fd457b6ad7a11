"""The simulator's validation figures (issue 24): the AReaL paper's shape at scale, and the simulator's own cost.

    python benchmarks/simulator.py                       # every experiment, 8 steps a point, 2 at a time
    python benchmarks/simulator.py --only scaling,eta    # some of them
    python benchmarks/simulator.py --only perf --steps 100   # the simulator's own speed at 512 GPUs

Experiments (``examples/sim_areal_paper.yaml``: 512 prompts x 16 answers a step, eta 4, 3:1 inference:training,
the H800 profiles of ``areal_sim/profiles``; each point a real ``areal simulate`` in a process of its own):

- ``scaling``: synchronous (eta 0) and asynchronous (eta 4) samples/s at 32 to 512 GPUs (1.5B): the async/sync
  speedup at each size, and strong scaling (throughput against 8x the 64-GPU point's, "% of linear");
- ``weak``: asynchronous samples/s at 64 to 512 GPUs with the batch growing with the GPUs (64 groups at 64 GPUs,
  512 at 512: the same work per GPU), against 512/64 x the 64-GPU point ("% of linear");
- ``length``: the same speedup at 64 GPUs as the response-length cap grows (4k to 32k tokens, 7B);
- ``eta``: samples/s and the share of trained tokens at each staleness for eta 0, 1, 2, 4, 8 and unbounded
  (64 GPUs, 7B; pacing off so that the bound is what limits, and 1,024 groups in flight at most, which is what
  "unbounded" (eta 1000) is then held to);
- ``interrupt``: interruptible generation against drain-on-update (the engine cannot pause, so an update waits for
  the requests in flight) at eta 4 (64 GPUs, 1.5B and 7B);
- ``perf``: wall time of ``--steps`` steps at 512 GPUs (1.5B), and the wall ms per episode;
- ``plan``: ``areal plan``'s search against scoring every split at eta 0, 2, 4, on the three scenarios of
  ``plugins/engines/sim/tests/test_plan.py`` (its small config), with the simulations each needed.

Each point's samples/s is the report's ``steady_samples_per_s``: the trajectories of the second half of the steps
(the first ones fill the pipeline) over the simulated time they took. Results go to ``--out`` (JSON) and the tables
to stdout (markdown), the ones in ``benchmarks/simulator.md``.
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
        searched = Planner(str(config), extra, gpus=gpus, profile=profile, steps=5).plan((0, 2, 4))
        grid = Planner(str(config), extra, gpus=gpus, profile=profile, steps=5).plan((0, 2, 4), exhaustive=True)
    return {"searched": searched.best.allocation, "searched_eta": searched.best.eta,
            "searched_samples_per_s": searched.best.samples_per_s, "searched_simulations": searched.simulations,
            "grid": grid.best.allocation, "grid_eta": grid.best.eta, "grid_samples_per_s": grid.best.samples_per_s,
            "grid_simulations": grid.simulations, "steady_samples_per_s": searched.best.samples_per_s,
            "wall_s": 0.0}


def simulate(overrides: list[str]) -> dict:
    """One point, in this process (its report)."""
    import tempfile

    from areal_sim.simulate import run_simulation

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        report = run_simulation(CONFIG, overrides, folder)
    report["overrides"] = overrides
    return report


def points(name: str, steps: int) -> list[tuple[str, list[str]]]:
    base = [f"trainer.total_steps={steps}"]
    if name == "scaling":
        return [(f"scaling/{gpus}/eta{eta}", base + [f"sim.gpus={gpus}", "sim.profile=qwen2.5-1.5b-h800",
                                                      f"rollout.max_head_offpolicyness={eta}"])
                for gpus in (32, 64, 128, 256, 512) for eta in (0, 4)]
    if name == "weak":
        return [(f"weak/{gpus}", base + [f"sim.gpus={gpus}", "sim.profile=qwen2.5-1.5b-h800",
                                         f"rollout.batch_size={gpus}", f"rollout.max_concurrent_rollouts={8 * gpus}"])
                for gpus in (64, 128, 256, 512)]
    if name == "length":
        return [(f"length/{cap}/eta{eta}", base + ["sim.gpus=64", "sim.profile=qwen2.5-7b-h800",
                                                    f"rollout.sampling.max_new_tokens={cap}",
                                                    f"rollout.max_head_offpolicyness={eta}"])
                for cap in (4096, 8192, 16384, 32768) for eta in (0, 4)]
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
    if name == "perf":
        return [("perf/512", base + ["sim.gpus=512", "sim.profile=qwen2.5-1.5b-h800"])]
    raise SystemExit(f"--only: unknown experiment {name!r}; one of scaling, weak, length, eta, interrupt, plan, perf")


def tables(results: dict[str, dict]) -> str:
    out = []
    scaling = {k: v for k, v in results.items() if k.startswith("scaling/")}
    if scaling:
        out += ["| GPUs | sync samples/s | async samples/s | async / sync | async % of linear (from 64) | "
                "inference util. sync / async |", "|---|---|---|---|---|---|"]
        base = scaling.get("scaling/64/eta4")
        for gpus in (32, 64, 128, 256, 512):
            s, a = scaling.get(f"scaling/{gpus}/eta0"), scaling.get(f"scaling/{gpus}/eta4")
            if not (s and a):
                continue
            linear = f"{a['steady_samples_per_s'] / (base['steady_samples_per_s'] * gpus / 64):.0%}" if base else "-"
            out.append(f"| {gpus} | {s['steady_samples_per_s']:.1f} | {a['steady_samples_per_s']:.1f} | "
                       f"{a['steady_samples_per_s'] / s['steady_samples_per_s']:.2f}x | {linear} | "
                       f"{s['utilisation']['inference']:.0%} / {a['utilisation']['inference']:.0%} |")
        out.append("")
    weak = {k: v for k, v in results.items() if k.startswith("weak/")}
    if weak and "weak/64" in weak:
        out += ["| GPUs | batch (groups) | async samples/s | % of linear (from 64) | inference / train util. |",
                "|---|---|---|---|---|"]
        base = weak["weak/64"]["steady_samples_per_s"]
        for gpus in (64, 128, 256, 512):
            r = weak.get(f"weak/{gpus}")
            if r:
                out.append(f"| {gpus} | {r['batch_size']} | {r['steady_samples_per_s']:.1f} | "
                           f"{r['steady_samples_per_s'] / (base * gpus / 64):.0%} | "
                           f"{r['utilisation']['inference']:.0%} / {r['utilisation']['train']:.0%} |")
        out.append("")
    length = {k: v for k, v in results.items() if k.startswith("length/")}
    if length:
        out += ["| length cap | mean length | sync samples/s | async samples/s | async / sync |", "|---|---|---|---|---|"]
        for cap in (4096, 8192, 16384, 32768):
            s, a = length.get(f"length/{cap}/eta0"), length.get(f"length/{cap}/eta4")
            if s and a:
                mean = a["generated_tokens_per_s"] / max(a["samples_per_s"], 1e-9)
                out.append(f"| {cap} | {mean:.0f} | {s['steady_samples_per_s']:.2f} | {a['steady_samples_per_s']:.2f} | "
                           f"{a['steady_samples_per_s'] / s['steady_samples_per_s']:.2f}x |")
        out.append("")
    eta = {k: v for k, v in results.items() if k.startswith("eta/")}
    if eta:
        out += ["| eta | samples/s | vs eta 0 | trained tokens at staleness 0 / 1 / 2 / 3+ |", "|---|---|---|---|"]
        zero = eta.get("eta/0")
        for k in (0, 1, 2, 4, 8, 1000):
            r = eta.get(f"eta/{k}")
            if not r:
                continue
            lags = {int(lag): share for lag, share in r["staleness_tokens_by_lag"].items()}
            shares = [lags.get(0, 0.0), lags.get(1, 0.0), lags.get(2, 0.0), sum(v for g, v in lags.items() if g >= 3)]
            ratio = f"{r['steady_samples_per_s'] / zero['steady_samples_per_s']:.2f}x" if zero else "-"
            out.append(f"| {'unbounded' if k == 1000 else k} | {r['steady_samples_per_s']:.2f} | {ratio} | "
                       + " / ".join(f"{s:.0%}" for s in shares) + " |")
        out.append("")
    inter = {k: v for k, v in results.items() if k.startswith("interrupt/")}
    if inter:
        out += ["| model | drain-on-update samples/s | interruptible samples/s | gain |", "|---|---|---|---|"]
        for size in ("1.5b", "7b"):
            d, i = inter.get(f"interrupt/{size}/drain"), inter.get(f"interrupt/{size}/interruptible")
            if d and i:
                out.append(f"| {size} | {d['steady_samples_per_s']:.2f} | {i['steady_samples_per_s']:.2f} | "
                           f"{i['steady_samples_per_s'] / d['steady_samples_per_s'] - 1:+.0%} |")
        out.append("")
    plans = {k: v for k, v in results.items() if k.startswith("plan/")}
    if plans:
        out += ["| scenario | planned (search) | best of the grid | planned / best | simulations: search / grid |",
                "|---|---|---|---|---|"]
        for key, p in plans.items():
            out.append(f"| {key[5:]} | {p['searched']} eta {p['searched_eta']} | {p['grid']} eta {p['grid_eta']} | "
                       f"{p['searched_samples_per_s'] / p['grid_samples_per_s']:.1%} | "
                       f"{p['searched_simulations']} / {p['grid_simulations']} |")
        out.append("")
    perf = results.get("perf/512")
    if perf:
        out.append(f"512 GPUs, {perf['steps']} steps: {perf['wall_s']:.0f} s of wall time for {perf['simulated_s']:.0f} "
                   f"simulated s; {perf['episodes']} episodes, {perf['engine_calls']} engine calls, "
                   f"{perf['wall_ms_per_episode']:.1f} ms an episode")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="scaling,weak,length,eta,interrupt,plan")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="simulator.json")
    args = parser.parse_args(argv)
    todo = [p for name in args.only.split(",") for p in points(name, args.steps)]
    results: dict[str, dict] = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    todo = [(k, o) for k, o in todo if k not in results]  # a re-run finishes what an earlier one left
    began = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {key: pool.submit(plan_point if key.startswith("plan/") else simulate, overrides)
                   for key, overrides in todo}
        for key, future in futures.items():
            results[key] = future.result()
            Path(args.out).write_text(json.dumps(results, indent=1))
            print(f"{key}: {results[key]['steady_samples_per_s']:.2f} samples/s ({results[key]['wall_s']:.0f} s wall, "
                  f"{time.perf_counter() - began:.0f} s in)", file=sys.stderr, flush=True)
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
