"""Placement declarations of the ``sim`` backends (inference and train), and ``areal simulate``.

A simulated server models one server of the profile's tensor-parallel size,
and a simulated actor the train ranks of its layout, on GPUs or on CPU: every
layout the core accepts for data, tensor and pipeline parallelism is accepted,
since nothing runs on the devices.
"""

from __future__ import annotations

from areal_core import hookimpl
from areal_core.parallelism import BackendSupport


@hookimpl
def areal_declare_backends() -> list[BackendSupport]:
    return [
        BackendSupport("sim", "inference", dims="dt", devices=("gpu", "cpu"),
                       description="simulated inference servers: modelled latencies from a profile (areal-plugin-sim)"),
        BackendSupport("sim_train", "train", dims="dtp", devices=("gpu", "cpu"),
                       description="a simulated actor: the profile's training time on the modelled layout "
                                   "(areal-plugin-sim)"),
    ]


@hookimpl
def areal_register_commands(registrar) -> None:
    """``areal simulate`` and ``areal plan``: the commands live in :mod:`areal_sim.cli` (Typer, imported only by
    the CLI)."""
    from areal_sim.cli import plan, simulate

    registrar.add_command(simulate, "simulate")
    registrar.add_command(plan, "plan")
