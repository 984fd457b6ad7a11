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
