"""Running a test's worker script as several torch.distributed ranks on this machine, and the worker's side.

A train engine's multi-rank tests start ``python WORKER SPEC.json`` once per
rank with torchrun's variables (gloo, 127.0.0.1), wait for all of them with a
timeout, and fail with each rank's last log lines; the worker reads the spec,
joins the process group and leaves it whatever happens. Ranks see no GPU
(``CUDA_VISIBLE_DEVICES`` empty) and one thread each unless told otherwise.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from areal_core.processes.supervisor import free_port, rendezvous_env


def run_worker_ranks(worker: str | os.PathLike[str], spec: dict, folder: Path, world: int = 2,
                     timeout: float = 300, env: dict[str, str] | None = None) -> None:
    """Run ``worker`` on ``world`` ranks with ``spec`` plus ``"out": folder`` (written to ``folder/spec.json``;
    logs in ``folder/rank{r}.log``). Fails the test, quoting every rank's log tail, when any rank exits
    non-zero or they take longer than ``timeout`` seconds together (:func:`~areal_core.testing.scaled`)."""
    from areal_core.testing.waits import scaled

    timeout = scaled(timeout)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps({**spec, "out": str(folder)}))
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(folder / f"rank{rank}.log", "w")
        logs.append(log)
        rank_env = {**os.environ, **rendezvous_env(rank, world, port), "OMP_NUM_THREADS": "1",
                    "CUDA_VISIBLE_DEVICES": "", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(worker), str(folder / "spec.json")], env=rank_env,
                                      stdout=log, stderr=subprocess.STDOUT))
    timed_out = False
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        timed_out = True
        for p in procs:
            p.kill()
        codes = [p.wait() for p in procs]
    finally:
        for log in logs:
            log.close()
    if timed_out or any(codes):
        tails = "\n".join(f"--- rank {r} (exit {c}):\n" + "\n".join(
            (folder / f"rank{r}.log").read_text().splitlines()[-25:]) for r, c in enumerate(codes))
        what = f"did not finish within {timeout:.0f} s" if timed_out else f"exited with {codes}"
        pytest.fail(f"{world} ranks of {Path(worker).name} {what}:\n{tails}")


def rank_main(body: Callable[[dict], None], spec_path: str, timeout_s: float = 120) -> int:
    """A worker script's ``main``: the spec from ``spec_path``, a gloo process group from torchrun's variables
    (collectives give up after ``timeout_s``), ``body(spec)``; on a failure the group is destroyed and the
    error raised, on success the ranks pass a barrier and the process ends with :func:`areal_core.exits.exit_now`."""
    import torch.distributed as dist

    from areal_core.exits import exit_now

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        body(spec)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done: leave together, then end without the interpreter's finalization, where gloo's threads were seen to
    # abort the process after its work was done (areal_core.exits)
    dist.barrier()
    exit_now(0)
    return 0  # not reached
