"""Following a submitted job from `areal run`: progress, its end, Ctrl-C, and what to say when it fails.

The job says how it ended in ``slurm/status.json`` (the batch script writes
it before stopping anything); ``squeue`` says whether it is still in the
queue. The launcher returns only once the job has left the queue, so no
process of the run is left when `areal run` exits. Every wait is bounded
or has a reason: the job itself is waited for as long as SLURM lists it
(its time limit bounds it); after it ends, or after ``scancel``, the queue
is given ``launcher.cancel_timeout_s`` to let go.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from areal_core.processes.supervisor import Shutdown

from areal_plugin_slurm import slurm
from areal_plugin_slurm.files import Paths

FINAL = {"completed", "failed", "cancelled"}
STEP_WHAT = {"check": "same plugins and shared storage on every node", "servers": "the inference servers",
             "train": "the train ranks"}


def read_status(paths: Paths, job: str) -> dict | None:
    """This job's status (an older job's file is ignored); None before the job wrote one."""
    try:
        status = json.loads(paths.status.read_text())
    except (OSError, ValueError):
        return None
    return status if str(status.get("job")) == job else None


def tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 200 * n - 4096))
            return f.read().decode(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def quote(path: Path, n: int = 30) -> str:
    lines = tail(path, n)
    if not lines:
        return f"\n  (its log {path} is empty or missing)"
    return f"\n  last {len(lines)} lines of {path}:\n" + "\n".join(f"    {line}" for line in lines)


class Follower:
    """Waits for job ``job`` of the run in ``paths``; ``say`` prints one line above the progress bar."""

    def __init__(self, paths: Paths, job: str, options: Any, say: Callable[[str], None],
                 poll: Callable[[], Any]) -> None:
        self.paths, self.job, self.options, self.say, self.poll = paths, job, options, say, poll
        self.last_state: str | None = None
        self.squeue_failing = False

    # -- waiting --------------------------------------------------------------------------------------------

    def wait(self) -> dict | None:
        """Until the job records its end (the status), or leaves the queue without one (None)."""
        next_look = 0.0
        while True:
            self.poll()
            status = read_status(self.paths, self.job)
            if status is not None and status.get("state") in FINAL:
                return status
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + self.options.poll_s
                state = self._look()
                if state is not None and state.gone:
                    status = read_status(self.paths, self.job)  # it may have written its end just before leaving
                    return status if status is not None and status.get("state") in FINAL else None
            time.sleep(min(0.5, self.options.poll_s))

    def _look(self) -> slurm.JobState | None:
        try:
            state = slurm.job_state(self.job, self.options.submit_timeout_s)
        except slurm.SlurmCommandError as exc:
            if not self.squeue_failing:
                self.say(f"{exc}; still following the job through {self.paths.status}")
            self.squeue_failing = True
            return None
        self.squeue_failing = False
        if not state.gone and state.state != self.last_state:
            self.last_state = state.state
            where = f" on {state.nodes}" if state.state == "RUNNING" and state.nodes else ""
            why = f" ({state.reason})" if state.state == "PENDING" and state.reason not in ("", "None") else ""
            self.say(f"SLURM job {self.job} is {state.state.lower()}{where}{why}")
        return state

    def wait_gone(self, why: str) -> bool:
        """Until squeue no longer lists the job, at most launcher.cancel_timeout_s; says so when it still does."""
        deadline = time.monotonic() + self.options.cancel_timeout_s
        while time.monotonic() < deadline:
            try:
                if slurm.job_state(self.job, self.options.submit_timeout_s).gone:
                    return True
            except slurm.SlurmCommandError:
                pass
            time.sleep(min(1.0, self.options.poll_s))
        self.say(f"SLURM job {self.job} {why} but is still in the queue after {self.options.cancel_timeout_s:.0f} s "
                 f"(launcher.cancel_timeout_s); its processes may still be stopping: see `squeue -j {self.job}`")
        return False

    # -- stopping -------------------------------------------------------------------------------------------

    def cancel(self, reason: str) -> bool:
        """``scancel`` the job and wait (bounded) until it has left the queue; a second Ctrl-C stops the wait."""
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # already stopping; Ctrl-C still ends the wait below
        self.say(f"areal run {reason}: cancelling SLURM job {self.job} (scancel {self.job})")
        try:
            slurm.cancel(self.job, self.options.submit_timeout_s)
        except slurm.SlurmCommandError as exc:
            self.say(f"{exc}. Fix: cancel it yourself: scancel {self.job}")
            return False
        try:
            return self.wait_gone("was cancelled")
        except KeyboardInterrupt:
            self.say(f"stopped waiting; SLURM job {self.job} was cancelled and may still be stopping "
                     f"(squeue -j {self.job})")
            return False

    # -- saying how it ended --------------------------------------------------------------------------------

    def failure(self, status: dict | None) -> str:
        """Which step failed and how, with the last lines of the log of the task that failed first."""
        job_log = self.paths.job_log(self.job)
        if status is None:
            return (f"SLURM job {self.job} left the queue without recording how it ended (killed at its time limit "
                    f"after the grace period, a node failure, or scancel --signal=KILL); see `sacct -j {self.job}`"
                    f"{quote(job_log, 15)}")
        if status["state"] == "cancelled":
            return (f"SLURM job {self.job} was stopped by signal {status.get('code')} (scancel, its time limit "
                    f"(launcher.time) or a preemption); every step was stopped{quote(job_log, 10)}")
        step, code = status.get("step", "?"), int(status.get("code", 1))
        how = "ended with exit status 0 before training finished" if code == 0 else f"exited with status {code}"
        head = f"step {step} of SLURM job {self.job} ({STEP_WHAT.get(step, step)}) {how}"
        firsts = self._failures(step)
        if firsts:
            first = firsts[0]
            log = self.paths.step_log(step, first["task"])
            return f"{head}; task {first['task']} on node {first['node']} failed first{quote(log)}"
        logs = sorted(self.paths.logs.glob(f"slurm-{step}-*.log"))[:2]
        return head + "".join(quote(log, 15) for log in logs) + quote(job_log, 10)

    def _failures(self, step: str) -> list[dict]:
        found = []
        for path in self.paths.failures.glob(f"{step}-*.json"):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda f: f.get("time", 0))


@contextmanager
def signals_raise_shutdown() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise :class:`Shutdown` inside the block (as the local launcher's supervisor
    does), so `areal run` stopped by any of them cancels what it submitted; the previous handlers come back."""

    def raise_shutdown(signum, frame):
        raise Shutdown(signum)

    previous = {s: signal.signal(s, raise_shutdown) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def follow(follower: Follower) -> tuple[str, dict | None]:
    """Run ``follower.wait`` with SIGTERM/SIGINT/SIGHUP turned into a cancel: ("ended", status) or
    ("stopped", {"code": exit status, "why": ..., "gone": whether the job has left the queue})."""
    with signals_raise_shutdown():
        try:
            status = follower.wait()
        except Shutdown as exc:
            gone = follower.cancel(f"received {signal.Signals(exc.signum).name}")
            return "stopped", {"code": exc.exit_code, "why": str(exc), "gone": gone}
        except KeyboardInterrupt:
            gone = follower.cancel("interrupted")
            return "stopped", {"code": 130, "why": "interrupted", "gone": gone}
        try:
            follower.wait_gone("ended")
        except KeyboardInterrupt:  # the job has ended: only the queue's bookkeeping is left, not worth a cancel
            pass
        return "ended", status
