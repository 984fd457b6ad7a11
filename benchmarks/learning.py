"""The learning study: what asynchrony costs in accuracy, measured with real ``areal run``s on this machine.

    python benchmarks/learning.py                      # the whole grid (resumes where it stopped), then the report
    python benchmarks/learning.py --report             # the report from what has run so far
    python benchmarks/learning.py --small --out DIR    # 2 seeds x eta 0, 4, a few steps each: the pipeline's check

The grid: tasks x staleness bound eta (0, 1, 2, 4, 8) x objective (decoupled PPO, areal's default; naive PPO,
``algorithm.decoupled=false``: the ratio against the behaviour policy, no proximal policy) x seeds, every run the
built-in demo's setting (SmolLM2-135M-Instruct, GRPO, 2 groups of 8 a step) with the same number of steps, so the
same number of trained samples. Naive PPO at eta 0 is not run: with nothing stale its ratio is the decoupled one
(the proximal and behaviour policies are the same weights). The headline cells, eta 0 and eta 4 with decoupled
PPO, get ``--headline-seeds`` (5) seeds, the others ``--seeds`` (3).

Runs go one after another (this machine has 2 cores; two at once would measure each other). Each writes its run
folder under ``OUT/runs``; when it has finished (its last step and the evaluation after it are in its
``metrics.jsonl``) its record goes into ``OUT/results.json``, so an interrupted grid resumes at the first run
without a record (a run folder left half-written is started again).

Each run's record: the greedy accuracy on the task's held-out items (``eval.size``, measured every
``--eval-every`` steps beside training and after the last), against trained samples and against wall time since
the run's first step; the tokens it trained at each staleness (``staleness/tokens_at_lag_*``); its wall time.
The report (``OUT/learning.md`` and ``OUT/*.png``; ``--doc`` writes ``docs/results/learning.md`` and its
figures) gives per cell the final accuracy's mean and 95 % interval over seeds (Student's t), the samples and
the wall time to reach 90 % of eta 0's final accuracy, the staleness trained, the learning curves (mean and a
band of one standard deviation), and the two checks the AReaL paper makes: eta 4 with decoupled PPO against eta
0 at equal samples, and naive against decoupled PPO at each eta >= 4.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results" / "learning.md"

# task name -> the demo's overrides that make it (the demo: few-shot a + b with a, b in 0..20)
TASKS = {
    "addition": [],
    # operands of 1 or 2 digits (0..99): carries; the base model scores 0.156 greedy on its 64 held-out items
    # (areal eval demo dataset.digits=2) against 0.328 on the demo's
    "addition-2digit": ["dataset.digits=2"],
}
ETAS = (0, 1, 2, 4, 8)
OBJECTIVES = {"decoupled": [], "naive": ["algorithm.decoupled=false"]}
HEADLINE = {(0, "decoupled"), (4, "decoupled")}

# Student's t, two-sided 95 %, by degrees of freedom (1..30); beyond, the normal's 1.96
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def interval95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % confidence interval) of ``values`` (Student's t; 0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T95[len(values) - 2] if len(values) - 1 <= len(T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


@dataclass(frozen=True)
class Cell:
    task: str
    eta: int
    objective: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task}-eta{self.eta}-{self.objective}-s{self.seed}"

    @property
    def group(self) -> tuple[str, int, str]:
        return self.task, self.eta, self.objective


def grid(tasks: list[str], etas: tuple[int, ...], seeds: int, headline_seeds: int) -> list[Cell]:
    """Every run of the study, headline cells first (so a grid cut short has its main answer)."""
    cells = []
    for task in tasks:
        for eta in etas:
            for objective in OBJECTIVES:
                if objective == "naive" and eta == 0:
                    continue
                n = headline_seeds if (eta, objective) in HEADLINE else seeds
                cells += [Cell(task, eta, objective, seed) for seed in range(1, n + 1)]
    return sorted(cells, key=lambda c: ((c.eta, c.objective) not in HEADLINE, c.seed, c.task, c.eta, c.objective))


def run_cell(cell: Cell, out: Path, steps: int, eval_every: int, eval_size: int, extra: list[str],
             timeout_s: float) -> dict:
    """One ``areal run`` of ``cell``; its record."""
    folder = out / "runs" / "learning" / cell.name
    if folder.exists():
        shutil.rmtree(folder)  # a run that did not finish: start it again
    overrides = [f"output_dir={out / 'runs'}", "experiment=learning", f"trial={cell.name}",
                 f"trainer.total_steps={steps}", f"trainer.seed={cell.seed}", "trainer.save_every=0",
                 f"rollout.max_head_offpolicyness={cell.eta}", f"eval.every={eval_every}", f"eval.size={eval_size}",
                 "eval.before=true", *TASKS[cell.task], *OBJECTIVES[cell.objective], *extra]
    began = time.monotonic()
    with open(out / "runs" / f"{cell.name}.log", "w") as log:
        try:
            done = subprocess.run([sys.executable, "-m", "areal_cli.app", "run", *overrides], stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"learning: run {cell.name} did not finish in {timeout_s:.0f} s (--run-timeout); its "
                             f"log: {log.name}") from None
    if done.returncode != 0:
        raise SystemExit(f"learning: run {cell.name} failed (exit {done.returncode}); its log: {log.name}")
    return record(cell, folder, steps, time.monotonic() - began)


def record(cell: Cell, folder: Path, steps: int, wall_s: float) -> dict:
    """What the study keeps of a finished run: its accuracy curve, staleness and time, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = (folder / "config.yaml").read_text()
    import yaml

    cfg = yaml.safe_load(config)
    per_step = int(cfg["rollout"]["batch_size"]) * int(cfg["rollout"]["group_size"])
    start = min(r["time"] - r.get("time/step_s", 0.0) for r in rows if r.get("step", 0) >= 1)
    curve, lags = [], {}
    for r in rows:
        if "eval/accuracy" in r:
            after = int(r.get("eval/after_step", r["step"]))
            # wall time: when the step the evaluation scored had ended (the evaluation itself runs beside training)
            ended = next((x["time"] for x in rows if x.get("step") == after and "time/step_s" in x), start)
            curve.append({"step": after, "samples": after * per_step, "wall_s": max(0.0, ended - start),
                          "accuracy": r["eval/accuracy"]})
        for key, value in r.items():
            if key.startswith("staleness/tokens_at_lag_") and value:
                lag = key.rsplit("_", 1)[1]
                lags[lag] = lags.get(lag, 0.0) + value
    curve = sorted({c["step"]: c for c in curve}.values(), key=lambda c: c["step"])
    if not curve or curve[-1]["step"] != steps:
        raise SystemExit(f"learning: run {cell.name} has no evaluation after its last step {steps} in "
                         f"{folder / 'metrics.jsonl'}")
    total = sum(lags.values()) or 1.0
    return {"task": cell.task, "eta": cell.eta, "objective": cell.objective, "seed": cell.seed, "steps": steps,
            "samples": steps * per_step, "wall_s": wall_s, "final_accuracy": curve[-1]["accuracy"], "curve": curve,
            "staleness": {lag: v / total for lag, v in sorted(lags.items(), key=lambda kv: int(kv[0]))}}


def to_reach(curve: list[dict], target: float) -> tuple[float, float] | None:
    """(samples, wall seconds) at the first evaluation at or above ``target``; None if it never gets there."""
    for point in curve:
        if point["accuracy"] >= target:
            return point["samples"], point["wall_s"]
    return None


def summarise(runs: list[dict]) -> dict:
    """Per (task, eta, objective): n, final accuracy (mean, 95 % half-width), samples and wall time to 90 % of eta
    0's final mean (over the seeds that reach it), staleness; and the two checks."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["eta"], r["objective"]), []).append(r)
    cells = {}
    for (task, eta, objective), members in sorted(groups.items()):
        mean, half = interval95([m["final_accuracy"] for m in members])
        base = groups.get((task, 0, "decoupled"))
        target = 0.9 * statistics.fmean(m["final_accuracy"] for m in base) if base else None
        reached = [to_reach(m["curve"], target) for m in members] if target is not None else []
        hits = [x for x in reached if x is not None]
        lags: dict[str, float] = {}
        for m in members:
            for lag, share in m["staleness"].items():
                lags[lag] = lags.get(lag, 0.0) + share / len(members)
        cells[f"{task}/eta{eta}/{objective}"] = {
            "task": task, "eta": eta, "objective": objective, "n": len(members), "final_mean": mean,
            "final_half": half, "target": target, "reached": f"{len(hits)}/{len(members)}",
            "samples_to_target": statistics.fmean(h[0] for h in hits) if hits else None,
            "wall_to_target_s": statistics.fmean(h[1] for h in hits) if hits else None,
            "wall_s": statistics.fmean(m["wall_s"] for m in members), "staleness": lags}
    checks = []
    for task in sorted({r["task"] for r in runs}):
        zero, four = cells.get(f"{task}/eta0/decoupled"), cells.get(f"{task}/eta4/decoupled")
        if zero and four:
            inside = zero["final_mean"] - zero["final_half"] <= four["final_mean"] <= zero["final_mean"] + zero["final_half"]
            checks.append({"task": task, "claim": "eta 4 (decoupled) within eta 0's 95 % interval at equal samples",
                           "a": four, "b": zero, "holds": inside})
        for eta in (e for e in ETAS if e >= 4):
            naive, dec = cells.get(f"{task}/eta{eta}/naive"), cells.get(f"{task}/eta{eta}/decoupled")
            if naive and dec:
                # Welch's difference: decoupled - naive, with a 95 % interval from both groups' spreads
                diff = dec["final_mean"] - naive["final_mean"]
                half = math.hypot(dec["final_half"], naive["final_half"])
                checks.append({"task": task, "claim": f"decoupled above naive PPO at eta {eta}", "a": dec,
                               "b": naive, "difference": diff, "difference_half": half,
                               "holds": diff - half > 0, "null": abs(diff) <= half})
    return {"cells": cells, "checks": checks}


def _curves(runs: list[dict], task: str, by: str):
    """(label, xs, mean accuracy, standard deviation) per (eta, objective) of ``task``, on the evaluation points
    the seeds share."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["task"] == task:
            groups.setdefault((r["eta"], r["objective"]), []).append(r)
    for (eta, objective), members in sorted(groups.items()):
        steps = sorted(set.intersection(*({p["step"] for p in m["curve"]} for m in members)))
        xs, means, sds = [], [], []
        for step in steps:
            points = [next(p for p in m["curve"] if p["step"] == step) for m in members]
            xs.append(statistics.fmean(p[by] for p in points))
            values = [p["accuracy"] for p in points]
            means.append(statistics.fmean(values))
            sds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
        yield f"eta {eta}, {objective} ({len(members)} seeds)", xs, means, sds


def plot(runs: list[dict], folder: Path) -> list[Path]:
    """Per task, accuracy against trained samples and against wall time: a mean line and a band of one standard
    deviation per (eta, objective)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in sorted({r["task"] for r in runs}):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        for ax, by, label in ((axes[0], "samples", "trained samples"), (axes[1], "wall_s", "wall time (s)")):
            for name, xs, means, sds in _curves(runs, task, by):
                line, = ax.plot(xs, means, marker="o", markersize=3, label=name,
                                linestyle="--" if "naive" in name else "-")
                ax.fill_between(xs, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                                color=line.get_color(), alpha=0.15)
            ax.set_xlabel(label)
            ax.set_ylabel("greedy accuracy (held-out)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{task}: mean over seeds, band = one standard deviation")
        fig.tight_layout()
        path = folder / f"learning-{task}.png"
        tmp = path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written


def report(results: dict, summary: dict, figures: list[Path], command: str) -> str:
    """The markdown report: the setting, the per-cell table, the checks, the figures."""
    meta = results["meta"]
    lines = [
        "# Learning study: what asynchrony costs in accuracy", "",
        f"`{command}` on {meta['cpu']} ({meta['cores']} cores), {meta['date']}; "
        f"{len(results['runs'])} runs, {sum(r['wall_s'] for r in results['runs'].values()) / 3600:.1f} h of runs.",
        "", f"Every run: the built-in demo's setting, {meta['steps']} steps ({meta['samples']} trained samples), "
        f"greedy accuracy on {meta['eval_size']} held-out items every {meta['eval_every']} steps. Intervals: 95 %, "
        "Student's t over seeds.", "",
        "| task | eta | objective | seeds | final accuracy | to 90 % of eta 0: seeds / samples / wall s | "
        "trained tokens by staleness | wall s a run |",
        "|---|---|---|---|---|---|---|---|"]
    for c in summary["cells"].values():
        samples = f"{c['samples_to_target']:.0f}" if c["samples_to_target"] is not None else "-"
        wall = f"{c['wall_to_target_s']:.0f}" if c["wall_to_target_s"] is not None else "-"
        lags = ", ".join(f"{lag}: {share:.0%}" for lag, share in c["staleness"].items())
        lines.append(f"| {c['task']} | {c['eta']} | {c['objective']} | {c['n']} | {c['final_mean']:.3f} "
                     f"+- {c['final_half']:.3f} | {c['reached']} / {samples} / {wall} | {lags} | {c['wall_s']:.0f} |")
    lines += ["", "## The checks", ""]
    for check in summary["checks"]:
        if "difference" in check:
            verdict = "holds" if check["holds"] else ("no difference either way" if check["null"] else "does not hold")
            lines.append(f"- {check['task']}: {check['claim']}: decoupled - naive = {check['difference']:+.3f} "
                         f"+- {check['difference_half']:.3f}: **{verdict}**")
        else:
            lines.append(f"- {check['task']}: {check['claim']}: {check['a']['final_mean']:.3f} against "
                         f"{check['b']['final_mean']:.3f} +- {check['b']['final_half']:.3f}: "
                         f"**{'holds' if check['holds'] else 'does not hold'}**")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "an unknown CPU"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="learning-study", help="results, run folders and the report")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--etas", default=",".join(map(str, ETAS)))
    parser.add_argument("--steps", type=int, default=100, help="steps a run (the same sample budget for every run)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--headline-seeds", type=int, default=5, help="seeds of eta 0 and eta 4 with decoupled PPO")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--small", action="store_true",
                        help="the pipeline's check: 2 seeds x eta 0, 4 (decoupled), 4 steps, 8 items every 2 steps")
    parser.add_argument("--report", action="store_true", help="only the report, from the runs recorded so far")
    parser.add_argument("--doc", action="store_true", help=f"write the report to {DOC.relative_to(ROOT)}")
    parser.add_argument("extra", nargs="*", help="overrides for every run (e.g. actor.optimizer.lr=2e-5)")
    args = parser.parse_args(argv)
    if args.small:
        args.tasks, args.etas, args.steps, args.seeds, args.headline_seeds = "addition", "0,4", 4, 0, 2
        args.eval_every, args.eval_size = 2, 8
    unknown = [t for t in args.tasks.split(",") if t not in TASKS]
    if unknown:
        raise SystemExit(f"--tasks: unknown task {unknown[0]!r}; the tasks are {', '.join(TASKS)}")
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    results["meta"] = {"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                       "steps": args.steps, "samples": None, "eval_every": args.eval_every,
                       "eval_size": args.eval_size}
    cells = grid(args.tasks.split(","), tuple(int(e) for e in args.etas.split(",")), args.seeds, args.headline_seeds)
    if args.small:
        cells = [c for c in cells if c.objective == "decoupled"]
    if not args.report:
        todo = [c for c in cells if c.name not in results["runs"]]
        for i, cell in enumerate(todo, 1):
            began = time.monotonic()
            results["runs"][cell.name] = run_cell(cell, out, args.steps, args.eval_every, args.eval_size,
                                                  args.extra, args.run_timeout)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            os.replace(tmp, path)  # a record is whole or absent
            print(f"learning: {cell.name}: final accuracy {results['runs'][cell.name]['final_accuracy']:.3f} "
                  f"({time.monotonic() - began:.0f} s; {i}/{len(todo)})", file=sys.stderr, flush=True)
    runs = [results["runs"][c.name] for c in cells if c.name in results["runs"]]
    if not runs:
        raise SystemExit(f"learning: no finished run in {path}: run the grid first (without --report)")
    results["meta"]["samples"] = runs[0]["samples"]
    summary = summarise(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    target = DOC.parent if args.doc else out
    target.mkdir(parents=True, exist_ok=True)
    figures = plot(runs, target)
    command = "python benchmarks/learning.py " + " ".join(argv)
    text = report(results, summary, figures, command.strip())
    (DOC if args.doc else out / "learning.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
