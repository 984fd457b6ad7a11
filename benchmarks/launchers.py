"""The demo under the ``local`` launcher and under ``ray`` (a Ray instance started by the run), side by side.

    .venv/bin/python benchmarks/launchers.py [--steps 6] [--repeats 1] [--no-netns]

Prints, for each launcher, the seconds from ``areal run`` to the first trained step (start-up: servers, model
loads, and for Ray the cluster, the placement group and the actors) and the seconds per step after the first
(steady state), then what Ray adds: start-up in seconds (target: at most 15 s) and per step in percent
(target: at most 5 %). Both run the built-in demo (SmolLM2-135M-Instruct, the embedded engine and fsdp on
this machine's CPUs) with the same seed and overrides; the Ray run reserves one CPU per process
(``launcher.server_cpus`` / ``rank_cpus``), which on this 2-core machine is the local launcher's own split.

The Ray run is started inside a network namespace that has only loopback (``unshare -rn``) where the machine
allows it, so Ray binds 127.0.0.1 instead of the machine's external address; ``--no-netns`` runs it plainly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AREAL = str(Path(sys.executable).with_name("areal"))


def netns(argv: list[str]) -> list[str]:
    return ["unshare", "-rn", "bash", "-c", 'ip link set lo up && exec "$@"', "netns", *argv]


def timed_run(argv: list[str], samples: Path, steps: int, timeout_s: float = 1800) -> tuple[float, float]:
    """(seconds to the first step, seconds per step after it), from when each step's row appears."""
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[float] = []
    while proc.poll() is None:
        rows = len(samples.read_text().splitlines()) if samples.exists() else 0
        while len(seen) < rows:
            seen.append(time.monotonic() - began)
        if time.monotonic() - began > timeout_s:
            proc.kill()
            raise SystemExit(f"waited {timeout_s:.0f} s for the run to finish: {' '.join(argv)}")
        time.sleep(0.05)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0 or len(seen) < steps:
        raise SystemExit(f"the run failed (exit {proc.returncode}, {len(seen)} of {steps} steps seen):\n{out[-3000:]}")
    return seen[0], (seen[-1] - seen[0]) / (len(seen) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="runs per launcher; medians are reported")
    parser.add_argument("--no-netns", action="store_true", help="run Ray outside a loopback-only namespace")
    args = parser.parse_args()
    use_netns = not args.no_netns and subprocess.run(netns(["true"]), capture_output=True).returncode == 0
    work = Path(tempfile.mkdtemp(prefix="areal-bench-launchers-"))
    common = [f"output_dir={work}", f"trainer.total_steps={args.steps}", "eval.size=0", "trainer.save_every=0"]
    results: dict[str, list[tuple[float, float]]] = {"local": [], "ray": []}
    try:
        for repeat in range(args.repeats):
            for name in ("local", "ray"):
                trial = f"{name}{repeat}"
                argv = [AREAL, "run", *common, f"trial={trial}", f"launcher.name={name}"]
                if name == "ray" and use_netns:
                    argv = netns(argv)
                samples = work / "demo" / trial / "samples.jsonl"
                first, per_step = timed_run(argv, samples, args.steps)
                results[name].append((first, per_step))
                print(f"{name:5s} run {repeat + 1}: first step after {first:6.1f} s, {per_step:6.2f} s/step after it",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: (statistics.median(f for f, _ in v), statistics.median(s for _, s in v)) for k, v in results.items()}
    added_start = med["ray"][0] - med["local"][0]
    added_step = (med["ray"][1] / med["local"][1] - 1) * 100
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "netns": use_netns,
                      "local": {"first_step_s": med["local"][0], "s_per_step": med["local"][1]},
                      "ray": {"first_step_s": med["ray"][0], "s_per_step": med["ray"][1]}}))
    print(f"ray adds {added_start:+.1f} s to start-up (target <= 15 s: {'met' if added_start <= 15 else 'NOT met'}) "
          f"and {added_step:+.1f} % per step (target <= 5 %: {'met' if added_step <= 5 else 'NOT met'}); "
          f"ray/local per step {med['ray'][1] / med['local'][1]:.3f}x")


if __name__ == "__main__":
    main()
