"""The SLURM commands the launcher uses (sbatch, squeue, scancel), each with a timeout and a message in words.

Kept apart from the launcher so that what the launcher asks SLURM, and how
it reads the answers, is in one place: ``sbatch --parsable`` prints
``<job id>[;<cluster>]``; ``squeue`` prints nothing (or "Invalid job id")
once a job has left the queue.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMANDS = ("sbatch", "squeue", "scancel")
# squeue states of a job that has ended (shown for a while with some configurations)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}


class SlurmCommandError(RuntimeError):
    """A SLURM command failed or did not answer in time; the message quotes what it said."""


def missing_commands() -> list[str]:
    return [name for name in COMMANDS if shutil.which(name) is None]


def missing_message(missing: list[str]) -> tuple[str, str]:
    """(message, fix) for SLURM commands that are not on PATH."""
    names = ", ".join(f"`{m}`" for m in missing)
    return (f"the slurm launcher submits and follows the run with sbatch, squeue and scancel, and {names} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH on this machine "
            f"(PATH={os.environ.get('PATH', '')})",
            "run `areal run` on a login node of the SLURM cluster (where `sbatch --version` works), or load "
            "SLURM's module first (`module load slurm`); to see the batch script without SLURM, add --dry-run; "
            "to run on this machine, set launcher.name=local")


def _run(argv: list[str], timeout_s: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(f"`{' '.join(argv)}` did not answer within {timeout_s:.0f} s "
                                f"(launcher.submit_timeout_s); the SLURM controller may be busy or down") from None
    except OSError as exc:
        raise SlurmCommandError(f"cannot run `{argv[0]}`: {exc}") from None


def _said(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr.strip() or proc.stdout.strip() or "(no output)").splitlines()
    return "\n    ".join(text[-10:])


def submit(script: Path, cwd: Path, timeout_s: float) -> str:
    """``sbatch --parsable script``; the job id."""
    proc = _run(["sbatch", "--parsable", str(script)], timeout_s, cwd)
    if proc.returncode != 0:
        raise SlurmCommandError(f"sbatch refused {script} (exit status {proc.returncode}):\n    {_said(proc)}\n"
                                f"Fix: correct the launcher option it names (launcher.partition, launcher.account, "
                                f"launcher.time, launcher.qos, launcher.sbatch_lines, launcher.gpus_per_node)")
    job = proc.stdout.strip().splitlines()[-1].split(";")[0].strip() if proc.stdout.strip() else ""
    if not job.isdigit():
        raise SlurmCommandError(f"sbatch --parsable answered {proc.stdout.strip()!r}, not a job id")
    return job


@dataclass(frozen=True)
class JobState:
    state: str | None  # PENDING, RUNNING, COMPLETING, ...; None once the job has left the queue
    reason: str = ""
    nodes: str = ""

    @property
    def gone(self) -> bool:
        return self.state is None or self.state in ENDED


def job_state(job: str, timeout_s: float) -> JobState:
    proc = _run(["squeue", "--noheader", f"--jobs={job}", "--format=%T|%r|%N"], timeout_s)
    if proc.returncode != 0:
        if "invalid job id" in (proc.stderr + proc.stdout).lower():
            return JobState(None)
        raise SlurmCommandError(f"squeue about job {job} failed (exit status {proc.returncode}): {_said(proc)}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        return JobState(None)
    state, _, rest = lines[0].strip().partition("|")
    reason, _, nodes = rest.partition("|")
    return JobState(state.strip().upper(), reason.strip(), nodes.strip())


def cancel(job: str, timeout_s: float) -> None:
    proc = _run(["scancel", job], timeout_s)
    if proc.returncode != 0:
        raise SlurmCommandError(f"scancel {job} failed (exit status {proc.returncode}): {_said(proc)}")
