"""Where a SLURM run keeps its files, and the two file operations its steps coordinate with.

Steps on different nodes meet only through the run folder (shared storage,
checked by the check step): a server announces its address by writing a
file, the train ranks wait for it. Files are written atomically (a reader
never sees half an address) and every wait has a timeout that names what
is missing. Stdlib only: the step worker imports this before anything heavy.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class Paths:
    """The files of one run under ``<run_dir>/slurm`` (scripts, plan, status, coordination) and its logs."""

    run_dir: Path

    @property
    def slurm(self) -> Path:
        return self.run_dir / "slurm"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def batch(self) -> Path:
        return self.slurm / "job.sbatch"

    @property
    def step(self) -> Path:
        return self.slurm / "step.sh"

    @property
    def plan(self) -> Path:
        return self.slurm / "plan.json"

    @property
    def status(self) -> Path:
        return self.slurm / "status.json"

    @property
    def job_id(self) -> Path:
        return self.slurm / "job-id"

    @property
    def addresses(self) -> Path:
        return self.slurm / "addresses"

    def address(self, index: int) -> Path:
        return self.addresses / f"rollout-{index}"

    @property
    def train(self) -> Path:
        return self.slurm / "train"

    @property
    def rendezvous(self) -> Path:
        return self.train / "rendezvous"

    def rank(self, rank: int) -> Path:
        return self.train / f"rank-{rank}"

    @property
    def check(self) -> Path:
        return self.slurm / "check"

    @property
    def failures(self) -> Path:
        return self.slurm / "failures"

    def step_log(self, step: str, task: int | str) -> Path:
        return self.logs / f"slurm-{step}-{task}.log"

    def job_log(self, job_id: str) -> Path:
        return self.logs / f"slurm-job-{job_id}.log"

    def per_job(self) -> list[Path]:
        """What one job leaves for the next to ignore: cleared at submission and again when the job starts."""
        return [self.status, self.addresses, self.train, self.check, self.failures]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` in one step (rename), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def wait_for(paths: list[Path], timeout_s: float, what: str, hint: str = "",
             poll_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
    """Block until every path exists; after ``timeout_s`` raise TimeoutError naming ``what`` and each missing
    file, plus ``hint`` (where to look)."""
    deadline = clock() + timeout_s
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return
        if clock() >= deadline:
            shown = ", ".join(str(p) for p in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                                               else "")
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}; {len(missing)} of {len(paths)} never "
                               f"appeared: {shown}.{(' ' + hint) if hint else ''}")
        time.sleep(poll_s)
