"""The Ray actor that runs one process of a run on the node Ray placed it on.

Each inference server and each train rank is a real subprocess, as under the
``local`` launcher, started by this actor through the core's
:class:`~areal_core.processes.supervisor.Supervisor`: its log goes to the run
folder's ``logs/`` (shared storage, so the launcher can quote it whatever
node it ran on), and it and everything it starts die with the actor (the
supervisor's trampoline asks the kernel for a signal when its parent, this
actor's worker process, dies). Killing the actor (``ray.kill``, a lost node)
therefore leaves nothing running.

The actor is threaded (``max_concurrency``) so that :meth:`wait` can block
while the launcher asks for the node, the log or a stop.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from areal_core.processes.nodes import (
    installed_plugins, read_storage_tokens, server_recipe, write_storage_tokens,
)
from areal_core.processes.supervisor import Managed, ProcessSpec, Supervisor, free_port


class NodeProcess:
    """One process of the run (``name``) on this actor's node; the launcher drives it by remote calls."""

    def __init__(self, name: str, log_dir: str) -> None:
        self.name = name
        self.sup = Supervisor(Path(log_dir))
        self.managed: Managed | None = None
        # Ray starts its workers at nice 15 (its worker_niceness), and what this actor starts inherits it: on a
        # node where anything else runs, training and generation would get the CPU last. Back to normal priority
        # where the node allows it (root, or CAP_SYS_NICE); where not, the launcher says how to start Ray instead.
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass

    def node(self) -> dict[str, Any]:
        """Where this actor runs: Ray's node id, the node's address, its host name, the GPUs Ray gave it."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def plugins(self) -> dict[str, str]:
        return installed_plugins()

    def write_tokens(self, node: str, folders: list[str]) -> dict[str, str]:
        return write_storage_tokens(node, folders)

    def read_tokens(self, files: dict[str, str]) -> dict[str, str]:
        return read_storage_tokens(files)

    def free_port(self) -> int:
        return free_port(self.node()["address"])

    def start_server(self, run_dir: str, index: int, threads: int, env: dict[str, str]) -> str:
        """Start inference server ``index`` listening on this node's address, wait until it is ready (the
        engine's own startup timeout); its ``host:port``."""
        host = self.node()["address"]
        port = free_port(host)
        recipe = server_recipe(run_dir, index, host, port)
        self.managed = self.sup.start(ProcessSpec(self.name, recipe.argv, env={**recipe.env, **env}, threads=threads))
        self.sup.wait_ready(self.managed, recipe.ready, recipe.startup_timeout_s, recipe.what)
        return f"{host}:{port}"

    def start(self, argv: list[str], env: dict[str, str], threads: int) -> int:
        self.managed = self.sup.start(ProcessSpec(self.name, argv, env=env, threads=threads))
        return self.managed.pid

    def wait(self) -> tuple[int, tuple[int | None, int | None]]:
        """Block until the process ends; its exit status (negative: killed by that signal) and its node's
        out-of-memory kill counter when it started and ended (``describe_exit`` tells a kill from outside by it)."""
        assert self.managed is not None, f"{self.name} was never started"
        self.managed.exited.wait()
        return self.managed.poll(), self.managed.oom_kills

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the supervisor's grace, everything this actor started."""
        self.sup.stop_all()
