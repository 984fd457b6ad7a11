"""STAND-IN for `scancel` (not SLURM): SIGCONT + SIGTERM to every process of the job (the batch script and its
steps, whatever session they are in), then SIGKILL to what is left after KillWait (SLURM_STANDIN_KILL_WAIT_S,
default 10 s). Unlike SLURM it returns only after that; an unknown job id is an error.
"""

from __future__ import annotations

import signal
import sys
import time

from standin_common import KILL_WAIT_S, job_processes, job_record, log_call, signal_all


def main(argv: list[str]) -> int:
    log_call("scancel", argv)
    jobs = [a for a in argv if not a.startswith("-")]
    if not jobs:
        print("scancel (stand-in): no job id given", file=sys.stderr)
        return 1
    for job in jobs:
        if job_record(job) is None:
            print(f"scancel: error: Kill job error on job id {job}: Invalid job id specified", file=sys.stderr)
            return 1
        signal_all(job_processes(job), signal.SIGCONT)
        signal_all(job_processes(job), signal.SIGTERM)
        deadline = time.monotonic() + KILL_WAIT_S
        while job_processes(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_all(job_processes(job), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
