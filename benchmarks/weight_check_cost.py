"""What the weight integrity gate (``rollout.weight_check``) costs the demo: seconds per step with it on and off.

    .venv/bin/python benchmarks/weight_check_cost.py [--steps 24] [--pairs 2] [--config FILE] [key=value ...]

Runs the built-in demo (or ``--config``) for real, ``--pairs`` times with
``rollout.weight_check=on`` and as many with ``off``, alternating which goes
first so both see the same drift in machine load; evaluation and checkpoints
are off. Per run: the mean ``time/step_s`` over steps 3..N (the first two
carry start-up), then on / off as a ratio with its standard error (from the
per-step spread of both arms). Beside it, what the gate spends in the on runs
as logged (``time/weight_digest_s``: rank 0 hashing what it sends;
``time/weight_digest_engines_s``: the engines hashing what they hold, inside
the pause), as a share of the step: a bound on the rise that does not depend
on step-time noise (the probe, at the first update and every 10th, is not in
it: its update is waited for, which the ratio includes). The issue's target:
under 3 % added per step. No pass / fail: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(mode: str, steps: int, config: str | None, extra: list[str], folder: Path) -> dict:
    argv = [str(Path(sys.executable).parent / "areal"), "run", *([config] if config else []),
            f"trainer.total_steps={steps}", "eval.size=0", "trainer.save_every=0", f"output_dir={folder}",
            f"trial=gate-{mode}", f"rollout.weight_check={mode}", *extra]
    began = time.perf_counter()
    with (folder / f"{mode}-stderr.txt").open("w+") as errors:  # a file, not a pipe: a full pipe stalls a run
        try:
            proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=errors, cwd=ROOT, timeout=3600)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{' '.join(argv)} ran past 3600 s") from None
        if proc.returncode:
            errors.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{errors.read()[-3000:]}")
    rows = [json.loads(x) for x in next(folder.rglob(f"gate-{mode}/metrics.jsonl")).read_text().splitlines() if x]
    rows = [r for r in rows if r.get("step", 0) >= 3 and "time/step_s" in r]
    gate = [r.get("time/weight_digest_s", 0.0) + r.get("time/weight_digest_engines_s", 0.0) for r in rows]
    return {"mode": mode, "steps": [r["time/step_s"] for r in rows], "gate_s": gate,
            "wall_s": time.perf_counter() - began}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--config", help="a run config (default: the built-in demo)")
    parser.add_argument("overrides", nargs="*", help="key=value passed to every run")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="areal-gate-cost-") as tmp:
        for pair in range(args.pairs):
            for mode in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                folder = Path(tmp) / f"{pair}"
                folder.mkdir(exist_ok=True)
                out = run(mode, args.steps, args.config, args.overrides, folder)
                results[mode].append(out)
                print(f"pair {pair} {mode:>3}: {statistics.fmean(out['steps']):.3f} s/step over "
                      f"{len(out['steps'])} steps ({out['wall_s']:.0f} s wall)", flush=True)
    steps = {m: [s for r in results[m] for s in r["steps"]] for m in results}
    mean = {m: statistics.fmean(steps[m]) for m in steps}
    # the standard error of a ratio of two independent means, to first order
    rel = math.sqrt(sum(statistics.variance(steps[m]) / len(steps[m]) / mean[m] ** 2 for m in steps))
    ratio = mean["on"] / mean["off"]
    gate = statistics.fmean(g for r in results["on"] for g in r["gate_s"])
    print(f"weight_check on: {mean['on']:.3f} s/step, off: {mean['off']:.3f} s/step "
          f"({len(steps['on'])} / {len(steps['off'])} steps)")
    print(f"on / off = {ratio:.4f} ({ratio - 1:+.1%} +- {rel * ratio:.1%} standard error; target < +3 %)")
    print(f"the gate's digests, as logged in the on runs: {gate:.3f} s a step = {gate / mean['on']:.1%} of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
