"""STAND-IN for `srun` inside a job (not SLURM): runs ``--ntasks`` copies of the command on this machine.

Tasks are spread in blocks over pretend nodes ``node<relative>``, ``node<relative+1>``, ... (``--nodes``,
``--ntasks-per-node``, ``--relative``), each with SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURMD_NODENAME,
SLURM_NTASKS, SLURM_STEP_NUM_NODES set, and its output in ``--output`` (``%t`` task, ``%n`` node index,
``%N`` node name, ``%j`` job). SLURM_STANDIN_NODE_ENV (JSON ``{node: {VAR: value}}``) gives one pretend node
its own environment (PYTHONPATH is prepended): another plugin version on one node, say.

Returns the first non-zero task status (a signal N as 128 + N); with ``--kill-on-bad-exit`` (``=1``) the other
tasks then get SIGTERM, and SIGKILL after a grace. SIGTERM / SIGINT to srun are passed on to the tasks, as
SLURM does. Resources (--gpus-per-task, --cpus-per-task, --exact, --overlap) are accepted and recorded only.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

from standin_common import NODE_ENV_ENV, log_call

WITH_VALUE = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks", "--ntasks-per-node":
              "ntasks-per-node", "-r": "relative", "--relative": "relative", "-o": "output", "--output": "output",
              "-J": "job-name", "--job-name": "job-name", "--gpus-per-task": "gpus-per-task", "-c": "cpus-per-task",
              "--cpus-per-task": "cpus-per-task", "-e": "error", "--error": "error"}
GRACE_S = 15.0
FORWARDED: list[int] = []  # signals received, passed on by the wait loop


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in WITH_VALUE:
            if not eq:
                i += 1
                value = argv[i]
            opts[WITH_VALUE[name]] = value
        else:
            opts[name.lstrip("-")] = value if eq else "1"
        i += 1
    return opts, argv[i:]


def task_env(t: int, node_index: int, local: int, opts: dict, nodes: int, ntasks: int) -> dict[str, str]:
    node = f"node{node_index}"
    env = {**os.environ, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node_index),
           "SLURMD_NODENAME": node, "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
           "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NAME": opts.get("job-name", "")}
    for key, value in json.loads(os.environ.get(NODE_ENV_ENV, "{}")).get(node, {}).items():
        env[key] = value + (os.pathsep + env[key] if key == "PYTHONPATH" and env.get(key) else "")
    return env


def output_path(pattern: str, t: int, node_index: int) -> str:
    return (pattern.replace("%t", str(t)).replace("%n", str(node_index)).replace("%N", f"node{node_index}")
            .replace("%j", os.environ.get("SLURM_JOB_ID", "0")))


def status_of(code: int) -> int:
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    opts, command = parse(argv)
    if not command:
        print("srun (stand-in): no command given", file=sys.stderr)
        return 1
    nodes, ntasks = int(opts.get("nodes", "1")), int(opts.get("ntasks", opts.get("nodes", "1")))
    per_node = int(opts.get("ntasks-per-node", "0")) or math.ceil(ntasks / nodes)
    relative = int(opts.get("relative", "0"))
    job_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    if relative + nodes > job_nodes or ntasks > nodes * per_node or math.ceil(ntasks / per_node) > nodes:
        print(f"srun: error: Unable to create step: --nodes={nodes} --relative={relative} --ntasks={ntasks} "
              f"--ntasks-per-node={per_node} do not fit the job's {job_nodes} node(s)", file=sys.stderr)
        return 1
    log_call("srun", argv, options=opts, task_command=command)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: FORWARDED.append(signum))
    tasks = []
    for t in range(ntasks):
        index, local = relative + t // per_node, t % per_node
        out = open(output_path(opts["output"], t, index), "wb") if "output" in opts else None
        tasks.append(subprocess.Popen(command, env=task_env(t, index, local, opts, nodes, ntasks),
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None))
        if out:
            out.close()
    kill_on_bad_exit = opts.get("kill-on-bad-exit", "0") != "0"
    first_bad, stopping_since = 0, None
    while None in [p.poll() for p in tasks]:  # a list, not any(): every task is polled each round
        if FORWARDED:
            for p in tasks:
                if p.poll() is None:
                    p.send_signal(FORWARDED[0])
            FORWARDED.clear()
            stopping_since = stopping_since or time.monotonic()
        bad = next((p.returncode for p in tasks if p.returncode not in (None, 0)), 0)
        if bad and not first_bad:
            first_bad = status_of(bad)
            if kill_on_bad_exit:
                print(f"srun: error: task exited with exit code {first_bad}; terminating the step "
                      f"(--kill-on-bad-exit)", file=sys.stderr, flush=True)
                for p in tasks:
                    if p.poll() is None:
                        p.terminate()
                stopping_since = time.monotonic()
        if stopping_since and time.monotonic() - stopping_since > GRACE_S:
            for p in tasks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return first_bad or next((status_of(p.returncode) for p in tasks if p.returncode != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
