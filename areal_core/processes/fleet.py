"""A run's inference servers as processes of this machine: started, waited for, restarted when they exit
(``rollout.elastic``), and the threads each gets. The local launcher and ``areal eval`` start servers through
:class:`InferenceServers`; the Ray launcher's node workers reuse the same pieces."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_core.api import Context
from areal_core.processes.supervisor import (Managed, ProcessFailed, ProcessSpec, Supervisor, describe_exit,
                                             free_port, split_threads)
from areal_core.rollout.elastic import write_discovery_file


def thread_plan(n_servers: int, world_size: int, eta: int, cpu_count: int | None = None) -> tuple[list[int], list[int]]:
    """Threads for each inference server and each train rank on this machine.

    With ``eta`` > 0 generation and training run at the same time, so every
    process gets its own share of the cores. At ``eta`` = 0 they take turns
    (a batch is generated, then trained on, then the next is generated), so
    the servers share all the cores among themselves and so do the train
    ranks: a synchronous run uses the whole machine in each phase instead of
    leaving half of it idle, which is the honest baseline for what the
    asynchronous mode gains.
    """
    if eta == 0:
        return split_threads(n_servers, cpu_count), split_threads(world_size, cpu_count)
    threads = split_threads(n_servers + world_size, cpu_count)
    return threads[:n_servers], threads[n_servers:]



class ServerKeeper:
    """Restarts inference servers that exit during a run, within a budget (``rollout.elastic`` on).

    The trainer's health monitor drops a dead server from routing and its
    requests continue on the others; this side starts a replacement (a new
    port, so a late answer of the old one can never be taken for the new
    one's), waits for it with the engine's own startup timeout, and lists it
    in ``discovery_file``, from which the trainer's monitor adds it: it is
    brought to the current weights and joins at the next rebuild. The file
    lists only the restarted servers alive now, so one that died again is
    never re-added. ``budget`` restarts in all; past it a dead server is only
    dropped and the run goes on with the servers left (it stops when none is
    left: the trainer says so).
    """

    def __init__(self, sup: Supervisor, make: Callable[[int, int], Any], budget: int, discovery_file: Path,
                 say: Callable[[str], None], threads: dict[int, int]) -> None:
        self.sup, self.make, self.budget, self.say, self.threads = sup, make, budget, say, threads
        self.discovery_file = Path(discovery_file)
        # process name -> (server index, port); a restart is entered before it starts, so that an exit at once
        # is still known for a server's
        self.servers: dict[str, tuple[int, int]] = {}
        self.listed: dict[str, str] = {}  # process name -> address: the restarted servers that are up
        self.used = 0
        self._lock = threading.Lock()
        self._write()

    def track(self, name: str, index: int, port: int) -> None:
        self.servers[name] = (index, port)

    def on_exit(self, managed: Managed) -> bool:
        """Supervisor.watch's hook: True (taken care of) for a server, False for anything else."""
        if managed.name not in self.servers:
            return False
        index, port = self.servers[managed.name]
        with self._lock:
            self.listed.pop(managed.name, None)
            self._write()
            left = self.budget - self.used
            if left > 0:
                self.used += 1
                number = self.used
        what = f"{managed.name} (127.0.0.1:{port}) {describe_exit(managed.returncode, managed.oom_kills)}"
        if left <= 0:
            self.say(f"{what}; no restarts left (rollout.elastic.restarts={self.budget}), so the run goes on with "
                     f"the other inference servers; its log: {managed.log_path}")
            return True
        self.say(f"{what}; its requests continue on the other inference servers; restarting it (restart "
                 f"{number} of {self.budget}, rollout.elastic.restarts); its log: {managed.log_path}")
        threading.Thread(target=self._restart, args=(index, number), name=f"restart-rollout-{index}",
                         daemon=True).start()
        return True

    def _restart(self, index: int, number: int) -> None:
        port = free_port()
        server = self.make(index, port)
        name = f"rollout-{index}-restart{number}"
        self.track(name, index, port)
        try:
            managed = self.sup.start(ProcessSpec(name, server.argv, env=server.env, threads=self.threads.get(index)))
        except (RuntimeError, OSError) as exc:  # the run is being stopped, or the command cannot start
            self.say(f"rollout-{index} was not restarted: {exc}")
            return
        try:
            self.sup.wait_ready(managed, server.ready, server.startup_timeout_s, server.what)
        except ProcessFailed:
            return  # it ended: on_exit has it (another restart while the budget lasts)
        except TimeoutError as exc:
            self.say(f"restart {number} of rollout-{index} did not come up: {exc}")
            managed.kill()  # its exit goes to on_exit like any other
            return
        with self._lock:
            if managed.poll() is None:
                self.listed[name] = f"127.0.0.1:{port}"
                self._write()
        self.say(f"rollout-{index} is back on 127.0.0.1:{port} (restart {number} of {self.budget}); it rejoins "
                 f"routing with the current weights at the next rebuild (rollout.elastic.cooldown_s)")

    def _write(self) -> None:
        write_discovery_file(self.discovery_file, self.listed.values())


class InferenceServers:
    """The inference servers of a run's allocation that run as processes of their own on this machine (engines
    whose :meth:`~areal_core.api.InferenceEngine.server_process` gives one; the others live in the process that
    uses them), each on a free port of 127.0.0.1. ``areal run`` (the local launcher) and ``areal eval`` start
    them through this class, so a server is started one way only."""

    def __init__(self, run: Any) -> None:
        cfg, placement, engine_cls = run.config, run.placement("rollout"), run.components["rollout"]
        self.make: Callable[[int, int], Any] = lambda i, port: engine_cls.server_process(
            Context(config=cfg, options=run.options.get("rollout"), placement=placement), i, port)
        self.ports = [free_port() for _ in range(placement.parallel.d)]
        made = [self.make(i, port) for i, port in enumerate(self.ports)]
        self.servers = [(i, s) for i, s in enumerate(made) if s is not None]

    def start(self, sup: Supervisor, threads: list[int], keeper: ServerKeeper | None = None,
              prefix: str = "rollout") -> dict[int, str]:
        """Start every server (``threads[j]`` for the j-th), then wait for each with its own startup timeout;
        returns each server's address by index (``ProcessFailed`` or ``TimeoutError`` when one does not come
        up). Their logs are ``sup.log_dir/<prefix>-<index>.log``."""
        started, addresses = [], {}
        for (i, server), n in zip(self.servers, threads):
            managed = sup.start(ProcessSpec(f"{prefix}-{i}", server.argv, env=server.env, threads=n))
            started.append((managed, server))
            addresses[i] = f"127.0.0.1:{self.ports[i]}"
            if keeper is not None:
                keeper.track(managed.name, i, self.ports[i])
        for managed, server in started:
            sup.wait_ready(managed, server.ready, server.startup_timeout_s, server.what)
        return addresses
