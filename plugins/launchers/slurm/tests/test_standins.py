"""The SLURM stand-ins do what the other tests rely on (they are test doubles, not SLURM): srun spreads tasks
over pretend nodes, stops a step when a task fails, and squeue / scancel see every process of a job."""

from __future__ import annotations

import json
import subprocess
import time

from areal_core.testing import scaled, wait_until


def srun(standins, tmp_path, *args: str, job_nodes: int = 2, env: dict | None = None):
    base = standins.env({"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": str(job_nodes),
                         **(env or {})})
    return subprocess.run([str(standins.bin / "srun"), *args], env=base, capture_output=True, text=True,
                          timeout=scaled(60))


def test_srun_spreads_tasks_in_blocks_over_pretend_nodes(standins, tmp_path):
    out = tmp_path / "task-%t.log"
    proc = srun(standins, tmp_path, "--nodes=2", "--ntasks=3", "--relative=1", f"--output={out}", "bash", "-c",
                'echo "$SLURM_PROCID $SLURM_LOCALID $SLURMD_NODENAME $SLURM_NODEID ${EXTRA:-}"', job_nodes=3,
                env={"SLURM_STANDIN_NODE_ENV": json.dumps({"node2": {"EXTRA": "only-here"}})})
    assert proc.returncode == 0, proc.stderr
    assert [(tmp_path / f"task-{t}.log").read_text().split() for t in range(3)] == [
        ["0", "0", "node1", "1"], ["1", "1", "node1", "1"], ["2", "0", "node2", "2", "only-here"]]
    too_many = srun(standins, tmp_path, "--nodes=2", "--relative=1", "true")
    assert too_many.returncode == 1 and "do not fit the job's 2 node(s)" in too_many.stderr


def test_srun_returns_the_first_failure_and_stops_the_other_tasks(standins, tmp_path):
    started = time.monotonic()
    proc = srun(standins, tmp_path, "--ntasks=3", "--kill-on-bad-exit=1", "bash", "-c",
                '[ "$SLURM_PROCID" = 1 ] && exit 5; exec sleep 300')
    assert proc.returncode == 5
    assert time.monotonic() - started < scaled(10)  # the other tasks' 300 s sleeps were stopped
    assert "terminating the step (--kill-on-bad-exit)" in proc.stderr


def test_sbatch_squeue_and_scancel_follow_every_process_of_a_job(standins, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output=" + str(tmp_path / "job-%j.log") +
                      "\nsetsid sleep 60 &\necho started $SLURM_JOB_ID $SLURM_JOB_NUM_NODES\nwait\n")
    env = standins.env({"PATH": "/usr/bin:/bin"})
    job = subprocess.run([str(standins.bin / "sbatch"), "--parsable", str(script)], env=env, capture_output=True,
                         text=True, timeout=scaled(30)).stdout.strip()
    assert job == "1000"

    def squeue() -> str:
        return subprocess.run([str(standins.bin / "squeue"), "--noheader", f"--jobs={job}", "--format=%T %N"],
                              env=env, capture_output=True, text=True, timeout=scaled(30)).stdout.strip()

    wait_until(lambda: "started" in (tmp_path / "job-1000.log").read_text(), 10, "the batch script to start", 0.05)
    assert squeue() == "RUNNING node[0-1]"
    subprocess.run([str(standins.bin / "scancel"), job], env=env, timeout=scaled(30), check=True)
    assert squeue() == ""  # the batch script and the sleep it started in another session are gone
    unknown = subprocess.run([str(standins.bin / "squeue"), "--jobs=99"], env=env, capture_output=True, text=True)
    assert unknown.returncode == 1 and "Invalid job id" in unknown.stderr
    assert [c["command"] for c in standins.calls()] == ["sbatch", "squeue", "scancel", "squeue", "squeue"]
