"""The ``ray`` launcher: a run's processes placed across a Ray cluster.

``areal run CONFIG launcher.name=ray`` with everything else unchanged. What
happens, in order (each step bounded by a timeout that names what it waited
for; a failure at any step stops everything that was started):

1. Connect to the cluster at ``launcher.address`` (``auto``: the one this
   machine belongs to), or start a Ray instance on this machine when it is
   empty.
2. Reserve a placement group derived from the validated allocation (one
   bundle per process, :mod:`areal_plugin_ray.placement`), and put one
   :class:`~areal_plugin_ray.worker.NodeProcess` actor in each bundle.
3. Before anything is launched: every node reports its areal distributions
   (a different plugin set stops the run with the difference listed), and
   every node writes a token under the run folder and the weight-exchange
   folder that every other node reads back (a folder that is not shared
   stops the run naming node and path).
4. Inference servers start on their nodes, listening on the node's address,
   and are waited for; then the train ranks, with the torch.distributed
   rendezvous on the first rank's node. The trainer learns each server's
   address and node (``AREAL_ROLLOUT_<i>_ADDRESS`` / ``_NODE``) and picks how
   weights reach it: shared memory on its own node, the shared folder or the
   engine's process group across nodes (logged, and counted in the metrics).
5. The launcher shows the same progress bar as the ``local`` one and watches
   every actor. A train rank that fails, or an actor or node that is lost,
   stops the run with the process's role, node and last log lines (logs are
   in the run folder); with ``rollout.elastic`` on, a lost inference server
   is restarted by Ray in its bundle (within ``rollout.elastic.restarts``) and
   rejoins through the trainer's health monitor, and training goes on.
6. On exit, Ctrl-C, SIGTERM or a failure, every actor is asked to stop its
   process, then killed, the placement group is removed, and a Ray instance
   started here is shut down. Actors belong to this driver, so if the
   launcher itself is killed Ray kills them, and their processes die with
   them.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_core.api import Launcher
from areal_core.processes.follow import MetricsTail, checkpoint_step, console, report_failure, resume_command
from areal_core.processes.nodes import (
    NODE_ADDRESS_ENV, NODE_ENV, StorageReport, check_plugin_sets, installed_plugins, raise_storage_problems,
    remove_storage_tokens, trainer_argv, trainer_env,
)
from areal_core.processes.supervisor import Shutdown, describe_exit, format_tail, read_tail
from areal_core.rollout.elastic import LAUNCHER_DISCOVERY_ENV, write_discovery_file
from areal_core.server_guard import RUN_TOKEN_ENV, ensure_run_token
from areal_plugin_ray.placement import Plan, Slot, local_ranks, plan

STRATEGIES = ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def _lost_actor_errors() -> tuple[type[BaseException], ...]:
    """What ``ray.get`` raises when the actor it waits on is gone: the actor died (``RayActorError``), or Ray's
    memory monitor killed the worker (``OutOfMemoryError``, which is no ``RayActorError``)."""
    from ray.exceptions import OutOfMemoryError, RayActorError

    return RayActorError, OutOfMemoryError


def _how_lost(exc: BaseException) -> str:
    from ray.exceptions import OutOfMemoryError

    if isinstance(exc, OutOfMemoryError):
        return "was killed by Ray's memory monitor (its node ran low on memory)"
    return "died"


@dataclass
class RayLauncherConfig:
    """Keys of ``launcher`` when ``launcher.name: ray``."""

    address: str = field(default="", metadata={"help": "the Ray cluster to run on: 'host:port' of its head, "
                                               "'auto' for the one this machine belongs to, '' to start one here"})
    namespace: str = field(default="areal", metadata={"help": "Ray namespace of the run's actors"})
    num_cpus: int = field(default=0, metadata={"ge": 0, "help": "CPUs of a Ray instance started here; 0 = all"})
    strategy: str = field(default="PACK", metadata={"choices": STRATEGIES,
                                                    "help": "placement group strategy for the run's bundles"})
    server_cpus: int = field(default=1, metadata={"ge": 1, "help": "CPUs reserved (and threads) per inference server"})
    rank_cpus: int = field(default=1, metadata={"ge": 1, "help": "CPUs reserved (and threads) per train rank"})
    placement_timeout_s: float = field(default=120.0, metadata={
        "gt": 0.0, "help": "how long to wait for the cluster to have room for every bundle"})
    startup_timeout_s: float = field(default=900.0, metadata={
        "gt": 0.0, "help": "how long actors and processes may take to start (servers also have their own)"})
    stop_timeout_s: float = field(default=30.0, metadata={"gt": 0.0, "help": "how long processes get to stop"})


class RunFailed(RuntimeError):
    """The run cannot go on; the message says which process, where, and why."""


@dataclass
class Placed:
    slot: Slot
    actor: Any
    node: dict
    waiting: Any = None  # the future of actor.wait()
    log_name: str = ""  # the process's name and log file: the slot's, or a restart's

    def __post_init__(self) -> None:
        self.log_name = self.log_name or self.slot.name

    def where(self) -> str:
        return f"node {self.node['node_id'][:12]} ({self.node['hostname']}, {self.node['address']})"


class RayLauncher(Launcher):
    config_class = RayLauncherConfig

    def launch(self, run: Any, run_dir: Path, *, resume: bool = False) -> int:
        import ray

        options = self.context.options or RayLauncherConfig()
        run_dir = Path(run_dir).resolve()
        cfg = run.config
        restored = checkpoint_step(run_dir, verified=False) if resume else -1
        progress = MetricsTail(run_dir, cfg.trainer.total_steps, restored)
        previous = {s: signal.signal(s, _raise_shutdown) for s in (signal.SIGTERM, signal.SIGHUP)}
        session = RaySession(run, run_dir, options, progress)
        try:
            session.connect()
            session.execute(resume)
        except RunFailed as exc:
            progress.close()
            return report_failure(str(exc), run_dir)
        except Shutdown as exc:
            progress.close()
            console.print(f"areal run stopped ({exc}); every process it started on the Ray cluster was stopped. "
                          f"Continue with: {resume_command()}", highlight=False, markup=False)
            return exc.exit_code
        except KeyboardInterrupt:
            progress.close()
            console.print("areal run interrupted; every process it started on the Ray cluster was stopped. "
                          f"Continue with: {resume_command()}", highlight=False, markup=False)
            return 130
        finally:
            try:
                session.teardown()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
                if ray.is_initialized():
                    ray.shutdown()
        progress.close()
        console.print(f"areal run finished: {run_dir}")
        return 0


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise Shutdown(signum)


class RaySession:
    """One run on the cluster: the placement group, the actors, and what happened to them."""

    def __init__(self, run: Any, run_dir: Path, options: RayLauncherConfig, progress: MetricsTail) -> None:
        self.run, self.run_dir, self.options, self.progress = run, run_dir, options, progress
        self.cfg = run.config
        self.group: Any = None
        self.placed: list[Placed] = []
        self.servers: dict[int, Placed] = {}  # server index -> the actor serving it now
        self.plan: Plan | None = None
        self.keeper: RayServerKeeper | None = None

    # ------------------------------------------------------------ 1. the cluster
    def connect(self) -> None:
        import ray

        address = self.options.address or None
        kwargs: dict[str, Any] = {"namespace": self.options.namespace, "log_to_driver": False,
                                  "include_dashboard": False, "logging_level": "WARNING"}
        if address is None:
            # Ray runs its workers at nice 15 by default; a run's processes are the work, not background
            kwargs["_system_config"] = {"worker_niceness": 0}
            if self.options.num_cpus:
                kwargs["num_cpus"] = self.options.num_cpus
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"launcher.address={self.options.address!r}" if address else "a Ray instance on this machine"
            raise RunFailed(f"cannot start or reach {where}: {exc}. Fix: start the cluster (`ray start --head` on "
                            f"its head node) and give its address, or launcher.address='' to start one here") \
                from None

    # ------------------------------------------------------------ 2. placement
    def reserve(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        rollout, actor = self.run.placement("rollout"), self.run.placement("actor")
        engine_cls = self.run.components["rollout"]
        # Engines that run inside the trainer start no server (server_process returns None for them).
        probe = engine_cls.server_process(_probe_context(self.run), 0, 0) if rollout.parallel.d else None
        servers = rollout.parallel.d if probe is not None else 0
        self.plan = plan(self.run.allocation, rollout, actor, servers, self.options.server_cpus,
                         self.options.rank_cpus)
        self.group = placement_group(self.plan.bundles, strategy=self.options.strategy,
                                     name=f"areal-{self.cfg.experiment}-{self.cfg.trial}")
        ready, _ = ray.wait([self.group.ready()], timeout=self.options.placement_timeout_s)
        if not ready:
            raise RunFailed(
                f"waited {self.options.placement_timeout_s:.0f} s (launcher.placement_timeout_s) for the Ray cluster "
                f"to hold the run's {len(self.plan.bundles)} bundles with strategy {self.options.strategy} "
                f"({self.plan.describe()}); the cluster has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free. Fix: add nodes, free them, or ask less per process "
                f"(launcher.server_cpus, launcher.rank_cpus, the allocation)")

    def place(self, slots: list[Slot], name: str | None = None) -> list[Placed]:
        """An actor in each slot's bundle (Ray picks the node), and where each landed."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from areal_plugin_ray.worker import NodeProcess

        actors = [ray.remote(NodeProcess).options(
            num_cpus=slot.cpus, num_gpus=slot.gpus, max_concurrency=8, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=slot.bundle)
        ).remote(name or slot.name, str(self.run_dir / "logs")) for slot in slots]
        nodes = self._get([a.node.remote() for a in actors], f"the Ray actors of {', '.join(s.name for s in slots)} "
                                                            f"to start")
        placed = [Placed(slot, actor, node, log_name=name or slot.name) for slot, actor, node in zip(slots, actors, nodes)]
        self.placed.extend(placed)
        # Against this command's own niceness: a user who runs `areal run` under `nice` chose it for the run; only
        # what Ray added on top is worth a word (and only that can RAY_worker_niceness=0 undo).
        own = os.getpriority(os.PRIO_PROCESS, 0)
        niced = sorted({p.where() for p in placed if p.node["nice"] > own})
        if niced:
            self.progress.say(f"the run's processes on {', '.join(niced)} run at nice {max(p.node['nice'] for p in placed)} "
                              f"(Ray's worker niceness; `areal run` itself runs at nice {own}), so anything else on "
                              f"those nodes gets the CPU first; to run them at normal priority start Ray there with "
                              f"RAY_worker_niceness=0 (RAY_worker_niceness=0 ray start ...)")
        return placed

    def _get(self, ref: Any, what: str, timeout_s: float | None = None) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        timeout_s = timeout_s or self.options.startup_timeout_s
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise RunFailed(f"waited {timeout_s:.0f} s (launcher.startup_timeout_s) for {what}") from None
        except _lost_actor_errors() as exc:
            raise RunFailed(f"the Ray actor {_how_lost(exc)} while waiting for {what}: {_first_line(exc)}") from None

    # ------------------------------------------------------------ 3. checks
    def check_nodes(self) -> None:
        by_node: dict[str, Placed] = {}
        for p in self.placed:
            by_node.setdefault(p.node["node_id"], p)
        reports = {f"node {nid[:12]} ({p.node['hostname']})": self._get(p.actor.plugins.remote(), "a plugin report")
                   for nid, p in by_node.items()}
        check_plugin_sets(installed_plugins(), reports)
        folders = [str(self.run_dir), str(self.run_dir / "weights")]
        written = {nid: self._get(p.actor.write_tokens.remote(nid[:12], folders), "the storage check's writes")
                   for nid, p in by_node.items()}
        reports_ = []
        for nid, p in by_node.items():
            unreadable = {w[:12]: self._get(p.actor.read_tokens.remote(files), "the storage check's reads")
                          for w, files in written.items() if w != nid}
            reports_.append(StorageReport(nid[:12], written[nid], {w: u for w, u in unreadable.items() if u}))
        raise_storage_problems(reports_, folders)
        remove_storage_tokens(folders)

    # ------------------------------------------------------------ 4. processes
    def execute(self, resume: bool) -> None:
        from areal_core.processes.nodes import PluginSetMismatch, SharedStorageError

        self.reserve()
        assert self.plan is not None
        self.place(self.plan.slots)
        try:
            self.check_nodes()
        except (PluginSetMismatch, SharedStorageError) as exc:
            raise RunFailed(str(exc)) from None
        servers = [p for p in self.placed if p.slot.role == "rollout"]
        ranks = [p for p in self.placed if p.slot.role == "actor"]
        if self.cfg.rollout.elastic.enabled and servers:
            self.keeper = RayServerKeeper(self, self.run_dir / "restarted-servers.txt")
        starts = [(p, p.actor.start_server.remote(str(self.run_dir), p.slot.index, p.slot.cpus, self._node_env(p)))
                  for p in servers]
        addresses = {}
        for p, ref in starts:
            addresses[p.slot.index] = self._get_started(p, ref, f"inference server {p.slot.index} ({p.slot.name}) "
                                                                f"on {p.where()} to be ready")
            self.servers[p.slot.index] = p
            print(f"{p.slot.name} is up on {addresses[p.slot.index]}, {p.where()}", flush=True)
        master = (ranks[0].node["address"], self._get(ranks[0].actor.free_port.remote(), "a rendezvous port"))
        local = local_ranks([p.node["node_id"] for p in ranks])
        server_list = [(addresses[i], self.servers[i].node["node_id"]) for i in sorted(addresses)]
        extra = {LAUNCHER_DISCOVERY_ENV: str(self.keeper.discovery_file)} if self.keeper else {}
        for p in ranks:
            env = trainer_env(p.slot.index, len(ranks), master,
                              local[p.slot.index], p.node["node_id"], server_list,
                              {**extra, NODE_ADDRESS_ENV: p.node["address"], RUN_TOKEN_ENV: ensure_run_token(),
                               **self._devices(p)})
            self._get(p.actor.start.remote(trainer_argv(self.run_dir, resume), env, p.slot.cpus),
                      f"train rank {p.slot.index} to start on {p.where()}")
            print(f"{p.slot.name} started on {p.where()}, rendezvous on {master[0]}:{master[1]}", flush=True)
        self.watch(ranks)

    def _get_started(self, p: Placed, ref: Any, what: str) -> str:
        try:
            return self._get(ref, what)
        except RunFailed:
            raise
        except Exception as exc:  # the server's own failure, raised in the actor: quote its log
            raise RunFailed(f"{p.slot.name} on {p.where()} did not start: {_first_line(exc)}"
                            f"{self._log_tail(p.slot.name)}") from None

    def _node_env(self, p: Placed) -> dict[str, str]:
        # Ray starts its workers from its own processes, not this one: the run's secret goes with the rest
        return {NODE_ENV: p.node["node_id"], NODE_ADDRESS_ENV: p.node["address"], RUN_TOKEN_ENV: ensure_run_token()}

    def _devices(self, p: Placed) -> dict[str, str]:
        """Colocated train ranks use the GPUs of the server they share a bundle with."""
        if p.slot.shares_devices_with is None:
            return {}
        server = next(s for s in self.placed if s.slot.name == p.slot.shares_devices_with)
        return {"CUDA_VISIBLE_DEVICES": ",".join(server.node["gpu_ids"])} if server.node["gpu_ids"] else {}

    # ------------------------------------------------------------ 5. watching
    def watch(self, ranks: list[Placed]) -> None:
        import ray

        watched: dict[Any, Placed] = {}
        for p in self.placed:
            p.waiting = p.actor.wait.remote()
            watched[p.waiting] = p
        finished: set[int] = set()
        while len(finished) < len(ranks):
            if self.keeper is not None:
                for p in self.keeper.take_new():
                    p.waiting = p.actor.wait.remote()
                    watched[p.waiting] = p
            ready, _ = ray.wait(list(watched), num_returns=1, timeout=0.2)
            self.progress.poll()
            for ref in ready:
                p = watched.pop(ref)
                code, why = self._outcome(ref)
                if p.slot.role == "actor" and code == 0:
                    finished.add(p.slot.index)
                    continue
                if p.slot.role == "rollout" and self.keeper is not None:
                    self.keeper.lost(p, why)
                    continue
                raise RunFailed(f"{p.log_name} ({_role(p)}) on {p.where()} {why}{self._log_tail(p.log_name)}")
        self.progress.poll()

    def _outcome(self, ref: Any) -> tuple[int | None, str]:
        import ray

        try:
            code, oom_kills = ray.get(ref)
        except _lost_actor_errors() as exc:
            return None, f"was lost: its Ray actor {_how_lost(exc)} ({_first_line(exc)})"
        return code, describe_exit(code, tuple(oom_kills))

    def _log_tail(self, name: str, n: int = 15) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return format_tail(path, read_tail(path, n))

    # ------------------------------------------------------------ 6. teardown
    def teardown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        stops = [p.actor.stop.remote() for p in self.placed]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.options.stop_timeout_s)
        for p in self.placed:
            try:
                ray.kill(p.actor)
            except Exception:  # already dead  # noqa: BLE001
                pass
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - the cluster may be gone; nothing of ours is left on it then
                pass


def _role(p: Placed) -> str:
    return "inference server" if p.slot.role == "rollout" else f"train rank {p.slot.index}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _probe_context(run: Any) -> Any:
    from areal_core.api import Context

    return Context(config=run.config, options=run.options.get("rollout"), placement=run.placement("rollout"))


class RayServerKeeper:
    """Restarts lost inference servers through Ray (``rollout.elastic`` on), within ``rollout.elastic.restarts``.

    The trainer's health monitor drops a lost server from routing (its requests continue on the others); this
    side starts a replacement actor in the same bundle (Ray reschedules the bundle if its node is gone), starts
    the server there on a new port, and lists it in ``discovery_file``, from which the monitor adds it: it is
    brought to the current weights and joins at the next rebuild.
    """

    def __init__(self, session: RaySession, discovery_file: Path) -> None:
        self.session, self.discovery_file = session, discovery_file
        self.budget = session.cfg.rollout.elastic.restarts
        self.used = 0
        self.listed: dict[str, str] = {}  # actor name -> address, restarted servers that are up
        self._new: list[Placed] = []
        self._lock = threading.Lock()
        self._write()

    def lost(self, p: Placed, why: str) -> None:
        say = self.session.progress.say
        name = p.log_name
        with self._lock:
            self.listed.pop(name, None)
            self._write()
            number = self.used + 1 if self.used < self.budget else 0
            self.used += bool(number)
        what = f"{name} (inference server {p.slot.index}) on {p.where()} {why}"
        if not number:
            say(f"{what}; no restarts left (rollout.elastic.restarts={self.budget}), so the run goes on with the "
                f"other inference servers")
            return
        say(f"{what}; its requests continue on the other inference servers; Ray restarts it (restart {number} of "
            f"{self.budget}, rollout.elastic.restarts)")
        threading.Thread(target=self._restart, args=(p.slot, number), name=f"restart-{p.slot.name}",
                         daemon=True).start()

    def _restart(self, slot: Slot, number: int) -> None:
        say = self.session.progress.say
        name = f"{slot.name}-restart{number}"
        try:
            [p] = self.session.place([slot], name)
            address = self.session._get(p.actor.start_server.remote(
                str(self.session.run_dir), slot.index, slot.cpus, self.session._node_env(p)),
                f"restart {number} of {slot.name} to be ready")
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on with the servers it has
            say(f"restart {number} of {slot.name} did not come up: {_first_line(exc)}")
            return
        with self._lock:
            self.listed[name] = address
            self._write()
            self._new.append(p)
        say(f"{slot.name} is back on {address}, {p.where()} (restart {number} of {self.budget}); it rejoins "
            f"routing with the current weights at the next rebuild (rollout.elastic.cooldown_s)")

    def take_new(self) -> list[Placed]:
        with self._lock:
            new, self._new = self._new, []
        return new

    def _write(self) -> None:
        write_discovery_file(self.discovery_file, self.listed.values())

