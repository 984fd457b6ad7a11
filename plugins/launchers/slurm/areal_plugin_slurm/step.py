"""The worker every srun task runs: ``python -m areal_plugin_slurm.step check|servers|train RUN_DIR``.

- ``check`` (one task per node): this node's areal distributions and a
  shared-storage probe; task 0 compares every node with what the launcher
  recorded (``slurm/plan.json``) and fails the step, naming node, path and
  difference, before any server or train rank exists.
- ``servers`` (task i = inference server i): the engine's own recipe
  (``areal_core.processes.nodes.server_recipe``) on this node's address and a
  free port, waited for with the recipe's timeout; then its address goes to
  ``slurm/addresses/rollout-<i>`` and the task stays with the server.
- ``train`` (task r = rank r): waits for every server's address and rank 0's
  rendezvous, then runs the trainer as the local launcher would.

Each process runs under a :class:`~areal_core.processes.supervisor.Supervisor`
in this task, so it dies with the task (scancel, a failing step, a killed
node). A failure is printed to the task's log (``logs/slurm-<step>-<task>.log``)
and recorded in ``slurm/failures/`` for the launcher to quote.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from areal_plugin_slurm.files import Paths, read_json, wait_for, write_atomic


class StepFailed(RuntimeError):
    """What went wrong in this task, in words (the message is what the launcher shows)."""


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def node_address(node: str, override: str) -> str:
    """The address other nodes reach this one at: ``launcher.host`` when set, else the node name resolved (not a
    loopback), else the address this node routes outward from, else its name."""
    if override:
        return override
    try:
        address = socket.gethostbyname(node)
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
    except OSError:
        return node


def _threads(plan: dict) -> int:
    """Threads per process: --cpus-per-task when set, else the CPUs SLURM bound this task to."""
    return int(plan.get("cpus_per_task") or 0) or len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------- check

def check(paths: Paths, plan: dict, task: int, node: str) -> int:
    from areal_core.processes.nodes import (PluginSetMismatch, SharedStorageError, StorageReport, check_plugin_sets,
                                         installed_plugins, raise_storage_problems, read_storage_tokens,
                                         remove_storage_tokens, write_storage_tokens)

    folders = [str(paths.run_dir), str(paths.run_dir / "weights")]
    n, timeout = int(plan["nodes"]), float(plan["wait_timeout_s"])
    mine = {"node": node, "plugins": installed_plugins(), "written": write_storage_tokens(node, folders)}
    write_atomic(paths.check / f"report-{task}.json", json.dumps(mine))
    reports = [paths.check / f"report-{t}.json" for t in range(n)]
    not_shared = (f"A node whose report is missing did not start its check task (see logs/slurm-check-<task>.log) "
                  f"or does not see {paths.run_dir} as the other nodes do: output_dir must be on storage every "
                  f"node mounts at the same path.")
    wait_for(reports, timeout, f"the check reports of all {n} node(s) in {paths.check}", not_shared)
    everyone = [read_json(p) for p in reports]
    unreadable = {r["node"]: wrong for r in everyone if r["node"] != node
                  and (wrong := read_storage_tokens(r["written"]))}
    write_atomic(paths.check / f"seen-{task}.json", json.dumps({"node": node, "unreadable": unreadable}))
    if task != 0:  # task 0 judges for every node, so the message lists all of them at once
        print(f"areal: check on {node}: report written; task 0 compares the nodes", flush=True)
        return 0
    seen = [paths.check / f"seen-{t}.json" for t in range(n)]
    wait_for(seen, timeout, f"every node's reading of the others' storage probes in {paths.check}", not_shared)
    views = {v["node"]: v["unreadable"] for v in (read_json(p) for p in seen)}
    problems = []
    try:
        check_plugin_sets(plan["plugins"], {r["node"]: r["plugins"] for r in everyone},
                          here=f"the launcher's machine ({plan.get('launcher_host', '?')})")
    except PluginSetMismatch as exc:
        problems.append(str(exc))
    try:
        raise_storage_problems([StorageReport(r["node"], r["written"], views.get(r["node"], {}))
                                for r in everyone], folders)
    except SharedStorageError as exc:
        problems.append(str(exc))
    remove_storage_tokens(folders)
    if problems:
        raise StepFailed("\n".join(problems))
    names = ", ".join(sorted(r["node"] for r in everyone))
    print(f"areal: check passed on {n} node(s) ({names}): the same {len(plan['plugins'])} areal distributions as "
          f"the launcher's machine, and {' and '.join(folders)} shared", flush=True)
    return 0


# ---------------------------------------------------------------------- servers

def serve(paths: Paths, plan: dict, task: int, node: str) -> int:
    from areal_core.processes.nodes import NODE_ADDRESS_ENV, NODE_ENV, server_recipe
    from areal_core.processes.supervisor import ProcessFailed, ProcessSpec, Supervisor, free_port

    host = node_address(node, plan.get("host", ""))
    port = free_port(host)
    recipe = server_recipe(paths.run_dir, task, host, port)
    if recipe is None:
        raise StepFailed(f"rollout.backend runs no server of its own, yet the job has a servers step; submit the "
                         f"run again (areal run ... --resume) so the launcher writes the job anew")
    env = {**recipe.env, NODE_ENV: node, NODE_ADDRESS_ENV: host}
    with Supervisor(paths.logs) as sup:
        managed = sup.start(ProcessSpec(f"rollout-{task}", recipe.argv, env=env, threads=_threads(plan)))
        print(f"areal: inference server {task} starting on {node} ({host}:{port}); its log: {managed.log_path}\n"
              f"  $ {shlex.join(recipe.argv)}", flush=True)
        try:
            sup.wait_ready(managed, recipe.ready, recipe.startup_timeout_s, recipe.what)
            write_atomic(paths.address(task), f"{host}:{port} {node}\n")
            print(f"areal: inference server {task} is ready on {host}:{port}; address in {paths.address(task)}",
                  flush=True)
            sup.watch()
        except ProcessFailed as exc:
            raise StepFailed(str(exc)) from None
    raise StepFailed(f"inference server {task} (rollout-{task}) exited with code 0 while the run still needed it; "
                     f"its log: {managed.log_path}")


# ---------------------------------------------------------------------- train

def _read_address(path: Path) -> tuple[str, str]:
    address, _, node = path.read_text().strip().partition(" ")
    return address, node


def train(paths: Paths, plan: dict, task: int, node: str) -> int:
    from areal_core.processes.nodes import NODE_ADDRESS_ENV, trainer_argv, trainer_env
    from areal_core.processes.supervisor import ProcessFailed, ProcessSpec, Supervisor, free_port

    rank, world = task, int(plan["world_size"])
    timeout = float(plan["wait_timeout_s"])
    host = node_address(node, plan.get("host", ""))
    write_atomic(paths.rank(rank), node)
    if rank == 0:
        write_atomic(paths.rendezvous, f"{host}:{free_port(host)}")
    n = int(plan["servers"])
    wait_for([paths.address(i) for i in range(n)], timeout,
             f"the address file of each of the {n} inference server(s) in {paths.addresses}",
             f"A server writes its file once it answers; see logs/slurm-servers-<i>.log and logs/rollout-<i>.log "
             f"for the ones missing (launcher.step_wait_timeout_s sets this wait).")
    servers = [_read_address(paths.address(i)) for i in range(n)]
    wait_for([paths.rendezvous] + [paths.rank(r) for r in range(world)], timeout,
             f"rank 0's rendezvous address and the node of each of the {world} train rank(s) in {paths.train}",
             "See logs/slurm-train-<rank>.log for the ranks missing.")
    master_host, _, master_port = paths.rendezvous.read_text().strip().rpartition(":")
    nodes = [paths.rank(r).read_text().strip() for r in range(world)]
    local = (int(os.environ.get("SLURM_LOCALID", "0")), nodes.count(node))
    env = trainer_env(rank, world, (master_host, int(master_port)), local, node, servers,
                      extra={NODE_ADDRESS_ENV: host})
    with Supervisor(paths.logs) as sup:
        managed = sup.start(ProcessSpec(f"actor-rank{rank}", trainer_argv(paths.run_dir, bool(plan["resume"])),
                                        env=env, threads=_threads(plan)))
        print(f"areal: train rank {rank} of {world} on {node} (rendezvous {master_host}:{master_port}, "
              f"{n} server(s)); its log: {managed.log_path}", flush=True)
        try:
            sup.watch()
        except ProcessFailed as exc:
            raise StepFailed(str(exc)) from None
    print(f"areal: train rank {rank} finished", flush=True)
    return 0


# ---------------------------------------------------------------------- entry

ROLES = {"check": check, "servers": serve, "train": train}


def _stop_on_signals() -> None:
    """SIGTERM (scancel, a failing step, the time limit), SIGINT and SIGHUP raise Shutdown once, so the
    supervisor stops this task's processes; repeats (srun and scancel may both signal) are ignored."""
    from areal_core.processes.supervisor import Shutdown

    def handler(signum, frame):
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise Shutdown(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, handler)


def _record_failure(paths: Paths, role: str, task: int, node: str, message: str) -> None:
    print(f"areal: {role} task {task} on {node} failed: {message}", flush=True)
    try:
        write_atomic(paths.failures / f"{role}-{task}.json", json.dumps(
            {"step": role, "task": task, "node": node, "message": message, "time": time.time()}))
    except OSError as exc:
        print(f"areal: could not record the failure in {paths.failures}: {exc}", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ROLES:
        print(f"usage: python -m areal_plugin_slurm.step {{{'|'.join(ROLES)}}} RUN_DIR", file=sys.stderr)
        return 2
    from areal_core.processes.supervisor import Shutdown

    role, paths = argv[0], Paths(Path(argv[1]))
    task, node = int(os.environ.get("SLURM_PROCID", "0")), node_name()
    _stop_on_signals()
    try:
        return ROLES[role](paths, read_json(paths.plan), task, node)
    except Shutdown as exc:
        print(f"areal: {role} task {task} on {node} stopped ({exc}); its processes were stopped", flush=True)
        return exc.exit_code
    except (StepFailed, TimeoutError) as exc:
        _record_failure(paths, role, task, node, str(exc))
        return 1
    except Exception as exc:  # anything else: the traceback for whoever debugs it, one line for the launcher
        traceback.print_exc()
        _record_failure(paths, role, task, node, f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
