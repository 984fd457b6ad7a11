"""What the SLURM stand-ins share: their state folder, the job table, and the job's processes.

STAND-INS, NOT SLURM. They run a job on this machine so the slurm
launcher's scripts can be tested end to end without a cluster: every
"node" is this machine, named node0, node1, ... There are no resources,
no scheduling, no accounting; see the plugin's README for what they
cover and what they do not.

A job's processes are found the way SLURM's cgroups would find them: every
process started for the job (batch script, srun, tasks, and whatever they
start, in any session) carries ``SLURM_STANDIN_JOB=<state folder>:<id>`` in
its environment. Stdlib only.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

STATE_ENV = "SLURM_STANDIN_STATE"  # the folder of the job table and the call log (set by the test fixture)
JOB_ENV = "SLURM_STANDIN_JOB"
NODE_ENV_ENV = "SLURM_STANDIN_NODE_ENV"  # JSON {node: {VAR: value}}: per-node environment (PYTHONPATH prepended)
KILL_WAIT_S = float(os.environ.get("SLURM_STANDIN_KILL_WAIT_S", "10"))  # SLURM's KillWait, shorter


def state() -> Path:
    folder = os.environ.get(STATE_ENV)
    if not folder:
        sys.exit(f"{Path(sys.argv[0]).name} (stand-in): {STATE_ENV} is not set; the test fixture sets it")
    path = Path(folder)
    (path / "jobs").mkdir(parents=True, exist_ok=True)
    return path


def log_call(name: str, argv: list[str], **extra) -> None:
    """One JSON line per call in <state>/calls.jsonl, for tests to read."""
    row = {"command": name, "argv": argv, "time": time.time(), "pid": os.getpid(), **extra}
    with open(state() / "calls.jsonl", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(row) + "\n")


def next_job_id() -> str:
    with open(state() / "next-id", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        current = int(f.read().strip() or "1000")
        f.seek(0)
        f.truncate()
        f.write(str(current + 1))
    return str(current)


def job_record(job: str) -> dict | None:
    try:
        return json.loads((state() / "jobs" / f"{job}.json").read_text())
    except (OSError, ValueError):
        return None


def job_marker(job: str) -> str:
    return f"{state()}:{job}"


def job_processes(job: str) -> list[int]:
    """Pids of the live (not zombie) processes of the job, found by the marker in their environment."""
    needle = f"{JOB_ENV}={job_marker(job)}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                continue
            with open(f"/proc/{entry.name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # it ended while we looked, or is not ours to read
            continue
        found.append(int(entry.name))
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def nodelist(n: int) -> str:
    return "node0" if n == 1 else f"node[0-{n - 1}]"
