"""STAND-IN for `squeue` (not SLURM): lists a stand-in job while any process of it is alive.

RUNNING while its batch script runs, COMPLETING while other processes of the job are left (real SLURM would
kill them; the stand-in leaves them, so a test sees a launcher that did not clean up), gone afterwards.
Supports --noheader, --jobs=ID[,ID] / -j ID, --format with %i %j %T %r %N; an unknown id is an error, as
with SLURM.
"""

from __future__ import annotations

import sys

from standin_common import job_processes, job_record, log_call, nodelist, state


def main(argv: list[str]) -> int:
    jobs: list[str] | None = None
    fmt, header = "%i %j %T %r %N", True
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--noheader"):
            header = False
        elif arg.startswith("--jobs="):
            jobs = arg.split("=", 1)[1].split(",")
        elif arg in ("-j", "--jobs"):
            jobs = next(args).split(",")
        elif arg.startswith("--format="):
            fmt = arg.split("=", 1)[1]
        elif arg in ("-o", "--format"):
            fmt = next(args)
    log_call("squeue", argv)
    if jobs is None:
        jobs = sorted(p.stem for p in (state() / "jobs").glob("*.json"))
    lines = []
    for job in jobs:
        record = job_record(job)
        if record is None:
            print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
            return 1
        alive = job_processes(job)
        if not alive:
            continue
        leader = record["pid"] in alive
        state_word = "RUNNING" if leader else "COMPLETING"
        values = {"i": job, "j": record["directives"].get("job-name", "?"), "T": state_word, "r": "None",
                  "N": nodelist(int(record["directives"].get("nodes", "1")))}
        line = fmt
        for key, value in values.items():
            line = line.replace(f"%{key}", value)
        lines.append(line)
    if header and lines:
        print("JOBID NAME STATE REASON NODELIST")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
