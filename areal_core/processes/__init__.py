"""Process machinery every launcher, the controller, evaluation and the engines build on, owned by none of them:
the supervisor (process specs, start, readiness, teardown of whole process groups, port reservation:
:mod:`.supervisor`, its trampoline :mod:`.child`), what a run's processes on several nodes agree on (the
environment contract, the plugin-set and storage checks: :mod:`.nodes`), a run's inference servers as processes
(:mod:`.fleet`) and following a run from its terminal (:mod:`.follow`). Launchers import from here; nothing here
imports a launcher."""

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
