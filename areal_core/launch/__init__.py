"""The built-in ``local`` launcher (:mod:`areal_core.launch.local`). The process machinery every launcher builds on
is :mod:`areal_core.processes`; its names stay importable from here."""

from areal_core.processes.supervisor import (
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
