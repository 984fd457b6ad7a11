"""``areal simulate CONFIG [key=value ...] [--sweep key=v1,v2 ...] [--out DIR]`` (registered by the plugin's hooks)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def simulate(
    config: Annotated[str, typer.Argument(help="the YAML run config a real run takes")],
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="dotted overrides: the run's, and sim.gpus / sim.inference_gpus / sim.profile / sim.token_scale")]
    = None,
    sweep: Annotated[Optional[list[str]], typer.Option(
        "--sweep", help="key=v1,v2,...: simulate every value (several --sweep: their grid); writes sweep.json and "
                        "curves.png")] = None,
    out: Annotated[Optional[str], typer.Option(
        "--out", help="the folder to write to (default: the config's run folder, trial + '-sim'; with --sweep: "
                      "./simulations)")] = None,
) -> None:
    """Simulate a run at any scale: the real controller and trainer, simulated engines, a virtual clock."""
    from areal_core.problems import ProblemsError

    from areal_sim.simulate import SimulationError, parse_sweep, run_simulation, run_sweep, summary_lines

    try:
        if sweep:
            folder = Path(out or "simulations")
            points = run_sweep(config, list(overrides or []), parse_sweep(sweep), folder)
            for p in points:
                typer.echo(", ".join(f"{k}={v}" for k, v in p["point"].items()))
                for line in summary_lines(p["report"]):
                    typer.echo(f"  {line}")
            typer.echo(f"wrote {folder / 'sweep.json'} and {folder / 'curves.png'}")
        else:
            report = run_simulation(config, list(overrides or []), out)
            for line in summary_lines(report):
                typer.echo(line)
    except (SimulationError, ProblemsError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None


def plan(
    config: Annotated[str, typer.Argument(help="the YAML run config a real run takes (its backends are planned for)")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="dotted overrides of the run config")] = None,
    gpus: Annotated[int, typer.Option("--gpus", min=2, help="GPUs to split between inference and training")] = 8,
    profile: Annotated[str, typer.Option("--profile", help="the latency profile (areal_sim/profiles or a YAML)")]
    = "qwen2.5-7b-h800",
    eta: Annotated[str, typer.Option("--eta", help="staleness bounds to consider, comma-separated")] = "0,1,2,4,8",
    steps: Annotated[int, typer.Option("--steps", min=3, help="the most simulated steps per candidate (each stops "
                                                             "once its figure is steady)")] = 60,
    tolerance: Annotated[float, typer.Option("--tolerance", min=0.0, max=0.5, help="steady: the second-half rate moves "
                                             "by less than this share; 0: always --steps")] = 0.02,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="simulate every split, not a search")] = False,
) -> None:
    """Choose the inference/training split and the staleness bound by simulation; print the allocation."""
    from areal_core.problems import ProblemsError

    from areal_sim.plan import Planner
    from areal_sim.simulate import SimulationError

    try:
        etas = tuple(int(v) for v in eta.split(","))
    except ValueError:
        typer.echo(f"--eta {eta!r}: write whole numbers separated by commas, e.g. --eta 0,2,4", err=True)
        raise typer.Exit(1) from None
    try:
        result = Planner(config, list(overrides or []), gpus=gpus, profile=profile, steps=steps,
                         tolerance=tolerance).plan(etas, exhaustive)
    except (SimulationError, ProblemsError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    for line in result.lines():
        typer.echo(line)
