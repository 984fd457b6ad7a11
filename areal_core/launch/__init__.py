"""Launching a run's processes: the engine-agnostic process supervisor launchers build on."""

from areal_core.launch.supervisor import (
    Managed,
    ProcessFailed,
    ProcessSpec,
    Shutdown,
    Supervisor,
    free_port,
    rendezvous_env,
    split_threads,
)

__all__ = [
    "Managed",
    "ProcessFailed",
    "ProcessSpec",
    "Shutdown",
    "Supervisor",
    "free_port",
    "rendezvous_env",
    "split_threads",
]
