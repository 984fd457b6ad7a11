"""Fault injection on real runs: kill and hang each kind of process at random moments and check the documented
outcome (issue 21).

Every run is `areal run` in a subprocess: two real embedded inference servers (``areal_local.server``, a tiny
random model) and the counter train engine double on one or two ranks, checkpointing every two steps. A fault
is injected once a random number of steps is recorded, after a random delay, while the run holds two steps later
until the fault is in (so however loaded the machine, it is still going); seeds make each moment reproducible
(``pytest tests/test_faults.py -m slow -k "server-kill and 3"``). What each fault must give:

- a train rank killed: the launcher stops within seconds naming the rank and how it died, every process of the
  run is gone, and ``--resume`` finishes the run with each step recorded once and no item trained twice;
- a train rank hung (SIGSTOP, two ranks): the other rank gives up after ``trainer.collective_timeout_s`` and
  the run stops naming it; ``--resume`` as above;
- the launcher killed: every process follows it; ``--resume`` as above;
- the launcher stopped (SIGSTOP) and continued: the run finishes as if nothing happened;
- a server killed: without ``rollout.elastic`` the run stops naming the server; with it the run finishes
  (the server is dropped and restarted);
- a server hung (SIGSTOP): without elastic the run stops after ``rollout.request_timeout_s`` naming the server
  and the wait; with elastic it is dropped and the run finishes.

On every outcome: the trained versions of one trainer process only grow, and every loss token's lag stays
within ``rollout.max_head_offpolicyness`` (the train engine double records both, across processes).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_core.testing.processes import launched_pids, process_name, processes_mentioning, read_jsonl
from areal_core.testing.waits import scaled

pytestmark = pytest.mark.slow

AREAL = str(Path(sys.executable).with_name("areal"))
ETA = 1
STEPS = 10


class Run:
    """One trial of the faulty run: starts `areal run`, injects faults, checks what is left."""

    def __init__(self, tmp_path: Path, config: Path, env: dict, model: Path, trial: str, *extra: str) -> None:
        self.tmp_path, self.config, self.env, self.model, self.trial = tmp_path, config, env, model, trial
        self.runs = tmp_path / "runs"
        self.run_dir = self.runs / "areal" / trial
        self.lags = tmp_path / f"lags-{trial}.jsonl"
        self.released = tmp_path / f"released-{trial}"  # a run started with hold_at waits for this file
        self.args = [f"output_dir={self.runs}", f"trial={trial}", "rollout.backend=local", f"model.path={model}",
                     "model.dtype=float32", f"rollout.max_head_offpolicyness={ETA}", f"trainer.total_steps={STEPS}",
                     "trainer.save_every=2", "actor.step_s=0.25", "rollout.batch_size=2", *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, *more: str, hold_at: int | None = None) -> subprocess.Popen:
        """Start `areal run`; with ``hold_at``, the step that trains that version waits until :meth:`release`."""
        env = {**self.env, "AREAL_TEST_LAGS_FILE": str(self.lags)}
        if hold_at is not None:
            env["AREAL_TEST_HOLD_AT_VERSION"] = f"{hold_at}:{self.released}"
        self.proc = subprocess.Popen([AREAL, "run", str(self.config), *self.args, *more], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self.proc

    def start_until(self, steps: int, delay_s: float) -> None:
        """Start, and return ``delay_s`` after ``steps`` steps were trained: the moment of the fault. The run holds
        at the step of version ``steps + 2`` (before its last, STEPS - 1) until :meth:`release`, so it has not
        ended by the fault however long this process was kept off the CPU."""
        self.start(hold_at=steps + 2)
        self.wait_for_steps(steps)
        time.sleep(delay_s)

    def release(self) -> None:
        """Let a run started with ``hold_at`` go on past that step (call once the fault is in)."""
        self.released.touch()

    def wait_for_steps(self, n: int, timeout_s: float = 180) -> None:
        limit = scaled(timeout_s)
        deadline = time.monotonic() + limit
        while len(read_jsonl(self.lags)) < n:
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.monotonic() < deadline, f"waited {limit:.0f} s for {n} trained steps"
            time.sleep(0.02)

    def finish(self, timeout_s: float = 300) -> str:
        out, _ = self.proc.communicate(timeout=scaled(timeout_s))
        assert self.proc.returncode == 0, out
        return out

    def fails(self, within_s: float) -> tuple[str, float]:
        """The launcher's output and how long after this call it exited (it must, within scaled ``within_s``)."""
        began = time.monotonic()
        out, _ = self.proc.communicate(timeout=scaled(within_s))
        return out, time.monotonic() - began

    def pids(self, role: str) -> list[int]:
        """The real processes (not their trampolines) of ``role`` (server, trainer), in the order of their names."""
        module = {"server": "areal_local.server", "trainer": "areal_core.trainer"}[role]
        return launched_pids(module, str(self.model), str(self.run_dir))

    def assert_no_orphans(self, within_s: float = 20) -> None:
        deadline = time.monotonic() + scaled(within_s)
        while (left := processes_mentioning(str(self.run_dir)) + processes_mentioning(str(self.model))) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], f"processes of the run outlived it: {left}"

    def assert_trained_once_within_the_bound(self) -> None:
        metrics = read_jsonl(self.run_dir / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
        samples = read_jsonl(self.run_dir / "samples.jsonl")
        assert [s["step"] for s in samples] == list(range(1, STEPS + 1))
        items = [item for s in samples for item in s["items"]]
        assert len(items) == len(set(items)), "an item was trained twice"
        records = read_jsonl(self.lags)
        assert max(max(r["lags"], default=0) for r in records) <= ETA
        # A trainer process trains versions in order; a resumed one starts again at its checkpoint's version.
        versions = [r["version"] for r in records]
        segments = [[versions[0]]]
        for v in versions[1:]:
            (segments[-1].append(v) if v > segments[-1][-1] else segments.append([v]))
        assert all(seg == list(range(seg[0], seg[0] + len(seg))) for seg in segments), versions
        assert segments[-1][-1] == STEPS - 1


@pytest.fixture
def faulty_run(tmp_path, rl_doubles_env):
    pytest.importorskip("areal_local")
    from areal_core.testing import tiny_model

    model = tiny_model(tmp_path / "tiny", seed=0)
    config, env = rl_doubles_env

    def make(trial: str, *extra: str) -> Run:
        return Run(tmp_path, config, env, model, trial, *extra)

    return make


def moment(seed: int) -> tuple[random.Random, int, float]:
    rng = random.Random(seed)
    return rng, rng.randint(2, 6), rng.random() * 0.5


@pytest.mark.parametrize("seed", [0, 1])
def test_train_rank_killed(faulty_run, seed):
    rng, steps, delay = moment(seed)
    run = faulty_run(f"rank-kill-{seed}", "allocation=local:d2@cpu+rl_train_double:d2@cpu")
    run.start_until(steps, delay)
    trainers = run.pids("trainer")
    assert [process_name(pid) for pid in trainers] == ["actor-rank0", "actor-rank1"]
    rank = rng.randrange(2)
    os.kill(trainers[rank], signal.SIGKILL)
    run.release()
    out, took = run.fails(within_s=60)
    assert run.proc.returncode == 1 and "was killed by signal 9 (SIGKILL)" in out, out
    assert f"actor-rank{rank} was killed by signal 9" in out and took < scaled(30), (took, out)
    run.assert_no_orphans()
    run.start("--resume")
    run.finish()
    run.assert_trained_once_within_the_bound()
    run.assert_no_orphans()


def test_train_rank_hung(faulty_run):
    """A train rank stopped (SIGSTOP: a deadlock, a wedged device) holds the others in their next collective for
    trainer.collective_timeout_s, then the run stops naming the rank that gave up, and the stopped one is
    killed with the rest. With one train rank nothing waits on it: that case is not covered."""
    _, steps, delay = moment(5)
    run = faulty_run("rank-hang", "allocation=local:d2@cpu+rl_train_double:d2@cpu", "trainer.collective_timeout_s=15")
    run.start_until(steps, delay)
    trainers = run.pids("trainer")
    assert [process_name(pid) for pid in trainers] == ["actor-rank0", "actor-rank1"]
    os.kill(trainers[1], signal.SIGSTOP)
    run.release()
    out, took = run.fails(within_s=120)
    assert run.proc.returncode == 1 and "exited with code 1" in out, out
    assert "waited trainer.collective_timeout_s = 15 s" in out and "one of them is hung or lost" in out, out
    assert took < 15 + scaled(45), (took, out)  # the collective timeout under test, and the teardown after it
    run.assert_no_orphans()
    run.start("--resume")
    run.finish()
    run.assert_trained_once_within_the_bound()


@pytest.mark.parametrize("seed", [0, 1])
def test_launcher_killed(faulty_run, seed):
    _, steps, delay = moment(seed)
    run = faulty_run(f"launcher-kill-{seed}", "allocation=local:d2@cpu+rl_train_double:cpu")
    run.start_until(steps, delay)
    run.proc.send_signal(signal.SIGKILL)  # no cleanup runs in the launcher: its children must follow anyway
    run.release()
    run.proc.wait(scaled(30))
    run.assert_no_orphans()
    run.start("--resume")
    run.finish()
    run.assert_trained_once_within_the_bound()


def test_launcher_stopped_and_continued(faulty_run):
    _, steps, delay = moment(7)
    run = faulty_run("launcher-stop", "allocation=local:d2@cpu+rl_train_double:cpu")
    run.start(hold_at=steps + 2)
    run.wait_for_steps(steps)
    run.proc.send_signal(signal.SIGSTOP)
    time.sleep(2 + delay)  # how long the launcher stays stopped: the run must finish after any time
    run.proc.send_signal(signal.SIGCONT)
    run.release()
    run.finish()
    run.assert_trained_once_within_the_bound()
    run.assert_no_orphans()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_server_killed_or_hung(faulty_run, seed, elastic, fault):
    rng, steps, delay = moment(seed)
    extra = ["allocation=local:d2@cpu+rl_train_double:cpu", "rollout.request_timeout_s=8",
             "rollout.weight_sync=" + rng.choice(["disk", "tensors"])]
    if elastic:
        extra += ["rollout.elastic.enabled=true", "rollout.elastic.interval_s=0.5",
                  "rollout.elastic.failure_threshold=2", "rollout.elastic.cooldown_s=0"]
    run = faulty_run(f"server-{fault}-{'elastic' if elastic else 'plain'}-{seed}", *extra)
    run.start_until(steps, delay)
    servers = run.pids("server")
    assert [process_name(pid) for pid in servers] == ["rollout-0", "rollout-1"]
    victim = rng.randrange(2)
    os.kill(servers[victim], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    run.release()
    try:
        if elastic:
            out = run.finish()
            assert "left routing" in out
            if fault == "kill":
                assert "restarting it (restart 1 of 3" in out
            run.assert_trained_once_within_the_bound()
        else:
            # A kill ends the server's process: the launcher sees it at once. A hang is found by the trainer's
            # request timeout (8 s), then the run is torn down.
            out, took = run.fails(within_s=90)
            assert run.proc.returncode == 1, out
            if fault == "kill":
                assert f"rollout-{victim} was killed by signal 9" in out and took < scaled(30), (took, out)
            else:
                assert "rollout.request_timeout_s" in out and "waited 8 s" in out, out
                assert "embedded engine" in out and "127.0.0.1:" in out, out
                assert "areal: the run stopped at step" in out and "Traceback" not in out, out  # one paragraph
                assert took < 8 + scaled(52), (took, out)  # the request timeout under test, and the teardown
    finally:
        if fault == "hang":
            try:
                os.kill(servers[victim], signal.SIGCONT)  # a stopped process takes SIGTERM only once continued
            except ProcessLookupError:
                pass
    run.assert_no_orphans()
