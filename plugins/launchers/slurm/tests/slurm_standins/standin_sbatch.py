"""STAND-IN for `sbatch` (not SLURM): runs the batch script on this machine, in the background, in its own
session, with SLURM_JOB_ID and friends set; prints the job id (``--parsable``) or "Submitted batch job N".

Reads the script's ``#SBATCH`` lines for --nodes, --job-name and --output (``%j`` is the job id); the other
directives are recorded for tests, not enforced. The output folder must exist, as with SLURM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from standin_common import JOB_ENV, job_marker, log_call, next_job_id, nodelist, state


def directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines()[1:]:
        if not line.startswith("#"):
            break  # sbatch stops at the first command
        if line.startswith("#SBATCH"):
            option = line[len("#SBATCH"):].strip()
            key, _, value = option.lstrip("-").partition("=")
            found[key] = value
    return found


def main(argv: list[str]) -> int:
    parsable = "--parsable" in argv
    rest = [a for a in argv if a != "--parsable"]
    if len(rest) != 1 or rest[0].startswith("-"):
        print(f"sbatch (stand-in): usage: sbatch [--parsable] SCRIPT (got {argv})", file=sys.stderr)
        return 1
    script = Path(rest[0])
    try:
        text = script.read_text()
    except OSError as exc:
        print(f"sbatch: error: Unable to open file {script}: {exc}", file=sys.stderr)
        return 1
    found = directives(text)
    job = next_job_id()
    nodes = int(found.get("nodes", "1"))
    output = Path(found.get("output", "slurm-%j.out").replace("%j", job))
    if not output.is_absolute():
        output = Path.cwd() / output
    if not output.parent.is_dir():
        print(f"sbatch: error: the folder of --output {output} does not exist", file=sys.stderr)
        return 1
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NAME": found.get("job-name", script.name),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": nodelist(nodes),
           "SLURM_SUBMIT_DIR": str(Path.cwd()), "SLURMD_NODENAME": "node0", "SLURM_NODEID": "0",
           JOB_ENV: job_marker(job)}
    with open(output, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    (state() / "jobs" / f"{job}.json").write_text(json.dumps(
        {"job": job, "pid": proc.pid, "script": str(script), "directives": found, "output": str(output)}))
    log_call("sbatch", argv, job=job)
    print(job if parsable else f"Submitted batch job {job}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
