"""The process supervisor with real processes: environment, logs, failures, and no orphans."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_core.processes import (
    ProcessFailed,
    ProcessSpec,
    Supervisor,
    free_port,
    rendezvous_env,
    split_threads,
)
from areal_core.testing.waits import scaled, wait_until

PY = sys.executable
LINUX = sys.platform.startswith("linux")

# Starts `sleep 1000`, then atomically writes "<own pid> <sleep pid>" to argv[1] and sleeps.
SPAWNER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    helper = subprocess.Popen(["sleep", "1000"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(1000)
    """
)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie nobody has reaped yet counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False if LINUX else True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def survivors(pids: list[int], within_s: float = 5.0) -> list[int]:
    """The pids still alive after waiting up to scaled ``within_s`` for all of them to go."""
    deadline = time.monotonic() + scaled(within_s)
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def read_pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


def spawner(name: str, pid_file: Path) -> ProcessSpec:
    return ProcessSpec(name, [PY, "-c", SPAWNER, str(pid_file)])


# -- environment and logs -------------------------------------------------------


def test_processes_get_their_env_and_threads_and_log_to_log_dir(tmp_path):
    show = ("import os; print('threads', *(os.environ[v] for v in "
            "['OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'ROLE', 'AREAL_PROCESS_NAME']))")
    with Supervisor(tmp_path / "logs") as sup:
        a = sup.start(ProcessSpec("rollout-0", [PY, "-c", show], env={"ROLE": "server"}, threads=3))
        trainer_env = {"ROLE": "trainer", "OMP_NUM_THREADS": "5"}
        b = sup.start(ProcessSpec("actor-rank0", [PY, "-c", show], env=trainer_env, threads=1))
        sup.watch(timeout_s=scaled(20))
    assert a.poll() == 0 and b.poll() == 0
    assert a.log_path == tmp_path / "logs" / "rollout-0.log"
    assert a.tail()[-1] == "threads 3 3 server rollout-0"
    assert b.tail()[-1] == "threads 5 1 trainer actor-rank0"  # an explicit env var wins over `threads`


def test_cwd_is_used_and_a_missing_program_names_the_process(tmp_path):
    with Supervisor(tmp_path / "logs") as sup:
        m = sup.start(ProcessSpec("where", [PY, "-c", "import os; print(os.getcwd())"], cwd=str(tmp_path)))
        sup.watch(timeout_s=scaled(20))
        assert m.tail()[-1] == str(tmp_path)
        with pytest.raises(FileNotFoundError, match="cannot start ghost: 'no-such-program-xyz' is not on its PATH"):
            sup.start(ProcessSpec("ghost", ["no-such-program-xyz"]))
        with pytest.raises(ValueError, match="'where' was already started"):
            sup.start(ProcessSpec("where", [PY, "-c", "pass"]))


# -- watch ------------------------------------------------------------------------


def test_watch_returns_when_every_process_exits_zero(tmp_path):
    with Supervisor(tmp_path / "logs") as sup:
        ms = [sup.start(ProcessSpec(f"p{i}", [PY, "-c", f"import time; time.sleep({0.1 * i})"])) for i in range(3)]
        sup.watch(timeout_s=scaled(20))
        assert [m.poll() for m in ms] == [0, 0, 0]


def test_a_crash_is_raised_with_its_log_and_stops_the_others_and_their_children(tmp_path):
    crash = "import sys, time; time.sleep(0.5); print('CUDA out of memory on rank 1', file=sys.stderr); sys.exit(3)"
    with Supervisor(tmp_path / "logs", term_timeout_s=5) as sup:
        long_running = [sup.start(spawner(f"server-{i}", tmp_path / f"pids-{i}")) for i in range(2)]
        for i, m in enumerate(long_running):
            sup.wait_ready(m, (tmp_path / f"pids-{i}").exists, timeout_s=scaled(20), what="its pid file")
        sup.start(ProcessSpec("actor-rank1", [PY, "-c", crash]))
        with pytest.raises(ProcessFailed) as failed:
            sup.watch(timeout_s=scaled(20))
        err = failed.value
        assert (err.name, err.returncode) == ("actor-rank1", 3)
        assert "CUDA out of memory on rank 1" in err.log_tail
        assert str(err).startswith("actor-rank1 exited with code 3; last")
        assert "CUDA out of memory on rank 1" in str(err)
        pids = [m.pid for m in long_running] + [p for i in range(2) for p in read_pids(tmp_path / f"pids-{i}")]
        assert survivors(pids, within_s=0) == []  # watch returned only after stopping them


def test_watch_reports_the_first_failure_not_its_consequences(tmp_path):
    # "second" fails only because "first" did: the cause is what the user must see. Second is started first and
    # ends once told to, after first has ended.
    go = tmp_path / "first-ended"
    first = "import sys; print('the real cause'); sys.exit(7)"
    second = f"import pathlib, sys, time\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\nsys.exit(1)"
    with Supervisor(tmp_path / "logs") as sup:
        after = sup.start(ProcessSpec("second", [PY, "-c", second]))
        cause = sup.start(ProcessSpec("first", [PY, "-c", first]))
        assert cause.exited.wait(scaled(20)), "first did not end"
        go.touch()
        assert after.exited.wait(scaled(20)), "second did not end"  # both have ended before anyone looks
        with pytest.raises(ProcessFailed, match="first exited with code 7") as failed:
            sup.watch(timeout_s=scaled(20))
        assert failed.value.log_tail[-1] == "the real cause"


def test_death_by_signal_is_reported_as_such(tmp_path):
    with Supervisor(tmp_path / "logs") as sup:
        sup.start(ProcessSpec("oom", ["sh", "-c", "kill -9 $$"]))
        with pytest.raises(ProcessFailed, match=r"oom was killed by signal 9 \(SIGKILL\)") as failed:
            sup.watch(timeout_s=scaled(20))
        assert failed.value.returncode == -signal.SIGKILL


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cgroup_oom_counter_is_read_where_the_kernel_keeps_it(tmp_path, monkeypatch, version):
    from areal_core.processes import supervisor

    if version == "v2":
        (tmp_path / "user.slice" / "run").mkdir(parents=True)
        (tmp_path / "user.slice" / "run" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
        cgroup = "0::/user.slice/run\n"
    else:
        (tmp_path / "memory").mkdir()
        (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
        cgroup = "9:pids:/\n4:memory:/docker/abc\n0::/\n"  # the container sees its own cgroup as the root
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: cgroup if str(self) == "/proc/self/cgroup"
                        else real_read(self, *a, **k))
    assert supervisor.oom_kill_count(tmp_path) == (2 if version == "v2" else 5)
    assert supervisor.oom_kill_count(tmp_path / "nothing") is None


def test_a_sigkill_is_told_apart_from_the_out_of_memory_killer_by_the_counter():
    from areal_core.processes.supervisor import describe_exit

    assert describe_exit(-9, (4, 5)) == ("was killed by signal 9 (SIGKILL) by the kernel's out-of-memory killer "
                                         "(this cgroup's oom_kill counter went from 4 to 5 meanwhile): it ran out "
                                         "of memory")
    assert describe_exit(-9, (4, 4)).startswith("was killed by signal 9 (SIGKILL) from outside the run: no "
                                                "process of this cgroup was killed for memory meanwhile")
    assert "cannot be read" in describe_exit(-9, (None, None))
    assert describe_exit(-15, (4, 5)) == "was killed by signal 15 (SIGTERM)"


def test_a_real_sigkill_from_outside_is_named_so(tmp_path):
    from areal_core.processes.supervisor import oom_kill_count

    with Supervisor(tmp_path / "logs") as sup:
        sup.start(ProcessSpec("victim", ["sh", "-c", "kill -9 $$"]))
        with pytest.raises(ProcessFailed) as failed:
            sup.watch(timeout_s=scaled(20))
    if oom_kill_count() is None:
        pytest.skip("no readable cgroup memory counter here: the message says it cannot tell")
    assert "victim was killed by signal 9 (SIGKILL) from outside the run" in str(failed.value)


def test_watch_until_and_timeout(tmp_path):
    with Supervisor(tmp_path / "logs", term_timeout_s=2) as sup:
        server = sup.start(ProcessSpec("server", ["sleep", "1000"]))
        trainer = sup.start(ProcessSpec("trainer", [PY, "-c", "pass"]))
        sup.watch(until=lambda: trainer.poll() is not None, timeout_s=scaled(20))
        assert trainer.poll() == 0 and server.poll() is None
        with pytest.raises(TimeoutError, match="waited 0 s for every process to finish; still running: server"):
            sup.watch(timeout_s=0.1)
    assert server.poll() == -signal.SIGTERM


def test_on_exit_takes_care_of_an_expendable_process_and_its_replacement_is_watched(tmp_path):
    """An elastic run's dead server: the hook restarts it (from this thread or another) and the run goes on;
    a process the hook declines is still a failure, and nothing starts once the teardown has begun."""
    offered = []

    def on_exit(m):
        offered.append((m.name, m.poll()))
        if m.name == "server":
            threading.Thread(target=lambda: sup.start(ProcessSpec("server-restart1", ["sleep", "1000"]))).start()
            return True
        return False

    with Supervisor(tmp_path / "logs", term_timeout_s=2) as sup:
        sup.start(ProcessSpec("server", ["sh", "-c", "kill -9 $$"]))
        # the trainer ends once the replacement is starting (its log is opened first): after the server's exit
        restarted = tmp_path / "logs" / "server-restart1.log"
        waits = f"import pathlib, time\nwhile not pathlib.Path({str(restarted)!r}).exists(): time.sleep(0.01)"
        trainer = sup.start(ProcessSpec("trainer", [PY, "-c", waits]))
        sup.watch(until=lambda: trainer.poll() is not None, timeout_s=scaled(20), on_exit=on_exit)
        assert offered[0] == ("server", -signal.SIGKILL) and ("trainer", 0) in offered
        replacement = wait_until(lambda: next((m for m in sup.processes if m.name == "server-restart1"), None), 20,
                                 "the replacement server to be started")
        assert replacement.poll() is None
        sup.start(ProcessSpec("rank", [PY, "-c", "import sys; sys.exit(5)"]))
        with pytest.raises(ProcessFailed, match="rank exited with code 5"):
            sup.watch(timeout_s=scaled(20), on_exit=on_exit)
        assert replacement.poll() is not None  # the failure stopped everything, the replacement included
        with pytest.raises(RuntimeError, match="supervisor is stopping"):
            sup.start(ProcessSpec("late", ["sleep", "1000"]))
    assert [name for name, _ in offered].count("server") == 1  # each exit is offered once


# -- wait_ready ---------------------------------------------------------------------


def test_wait_ready_timeout_names_what_it_waited_for(tmp_path):
    with Supervisor(tmp_path / "logs") as sup:
        loads = "import time; print('loading weights', flush=True); time.sleep(1000)"
        m = sup.start(ProcessSpec("rollout-0", [PY, "-c", loads]))
        wait_until(lambda: m.tail()[-1:] == ["loading weights"], 20, "its first line")  # to be quoted
        start = time.monotonic()
        with pytest.raises(TimeoutError) as timeout:
            sup.wait_ready(m, lambda: False, timeout_s=1.0, what="the health endpoint")
        assert 0.9 < time.monotonic() - start < 1.0 + scaled(4)
        msg = str(timeout.value)
        assert msg.startswith("waited 1 s for the health endpoint (rollout-0")
        assert "loading weights" in msg


def test_wait_ready_treats_connection_errors_as_not_ready_and_quotes_the_last(tmp_path):
    def refused() -> bool:
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    with Supervisor(tmp_path / "logs") as sup:
        m = sup.start(ProcessSpec("rollout-0", ["sleep", "1000"]))
        with pytest.raises(TimeoutError, match="last check failed with ConnectionRefusedError"):
            sup.wait_ready(m, refused, timeout_s=0.3, what="the health endpoint")


def test_a_process_dying_during_wait_ready_is_raised(tmp_path):
    dies = "import sys; print('bad model path', file=sys.stderr); sys.exit(2)"
    with Supervisor(tmp_path / "logs") as sup:
        m = sup.start(ProcessSpec("rollout-0", [PY, "-c", dies]))
        expected = "rollout-0 exited with code 2 before the health endpoint was ready"
        with pytest.raises(ProcessFailed, match=expected) as failed:
            sup.wait_ready(m, lambda: False, timeout_s=scaled(20), what="the health endpoint")
        assert "bad model path" in failed.value.log_tail


# -- stopping -----------------------------------------------------------------------


def test_stop_all_kills_what_ignores_sigterm_and_is_idempotent(tmp_path):
    stubborn = "import signal as s, time; s.signal(s.SIGTERM, s.SIG_IGN); print('up', flush=True); time.sleep(99)"
    sup = Supervisor(tmp_path / "logs", term_timeout_s=0.5)
    m = sup.start(ProcessSpec("stubborn", [PY, "-c", stubborn]))
    sup.wait_ready(m, lambda: m.tail()[-1:] == ["up"], timeout_s=scaled(20), what="its first line")
    start = time.monotonic()
    sup.stop_all()
    assert time.monotonic() - start < 0.5 + scaled(4.5)  # term_timeout_s, then the kill
    assert m.poll() == -signal.SIGKILL and not alive(m.pid)
    sup.stop_all()


@pytest.mark.skipif(not LINUX, reason="needs the Linux trampoline")
def test_helpers_left_behind_by_a_finished_process_are_stopped(tmp_path):
    leaves_helper = ["sh", "-c", f"sleep 1000 & echo $! > {tmp_path / 'helper'}"]
    with Supervisor(tmp_path / "logs") as sup:
        sup.start(ProcessSpec("leaves-helper", leaves_helper))
        sup.watch(timeout_s=scaled(20))
        assert survivors(read_pids(tmp_path / "helper")) == []  # gone while the supervisor still runs


@pytest.mark.skipif(not LINUX, reason="needs the Linux trampoline")
def test_a_process_started_from_a_thread_outlives_the_thread(tmp_path):
    # The kernel sends the parent-death signal when the starting *thread* exits.
    with Supervisor(tmp_path / "logs") as sup:
        started = []
        t = threading.Thread(target=lambda: started.append(sup.start(ProcessSpec("server", ["sleep", "1000"]))))
        t.start()
        t.join()
        # the thread is gone from the kernel too (the parent-death signal, were it asked for, is sent by then)
        wait_until(lambda: not Path(f"/proc/self/task/{t.native_id}").exists(), 20, "the thread to exit")
        time.sleep(0.5)  # time for a signal sent to take effect: it is never sent, so this cannot fail wrongly
        assert started[0].poll() is None


@pytest.mark.skipif(not LINUX, reason="needs the Linux trampoline")
def test_the_command_dies_with_its_trampoline_even_when_the_trampoline_is_killed(tmp_path):
    """Ray SIGKILLs the children of a worker that died, which are the trampolines of the processes a Ray actor
    started: the command must not outlive them (it asked the kernel for SIGKILL at its parent's death)."""
    pid_file = tmp_path / "command"
    with Supervisor(tmp_path / "logs") as sup:
        managed = sup.start(ProcessSpec("cmd", ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 1000"]))
        sup.wait_ready(managed, lambda: pid_file.exists() and pid_file.read_text().strip() != "", scaled(20),
                       "its pid file")
        command = int(pid_file.read_text())
        assert alive(command)
        os.kill(managed.pid, signal.SIGKILL)  # the trampoline alone
        assert survivors([command]) == []


# -- the launcher itself dies -------------------------------------------------------

LAUNCHER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from areal_core.processes import ProcessSpec, Shutdown, Supervisor
    from areal_core.testing.waits import scaled

    out, spawner = Path(sys.argv[1]), sys.argv[2]
    with Supervisor(out / "logs", term_timeout_s=5) as sup:
        sup.install_signal_handlers()
        try:
            kids = [sup.start(ProcessSpec(f"spawner-{i}", [sys.executable, "-c", spawner, str(out / f"pids-{i}")]))
                    for i in range(2)]
            for i, kid in enumerate(kids):
                sup.wait_ready(kid, (out / f"pids-{i}").exists, timeout_s=scaled(20), what="its pid file")
            pids = [kid.pid for kid in kids] + [(out / f"pids-{i}").read_text() for i in range(2)]
            (out / "all.tmp").write_text(" ".join(map(str, pids)))
            os.replace(out / "all.tmp", out / "all")
            sup.watch()
        except Shutdown as stop:
            sys.exit(stop.exit_code)
    """
)


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        pytest.param(signal.SIGKILL, marks=pytest.mark.skipif(not LINUX, reason="needs PR_SET_PDEATHSIG")),
    ],
    ids=lambda s: s.name,
)
def test_no_orphans_when_the_launcher_dies(tmp_path, sig):
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    launcher = subprocess.Popen([PY, str(tmp_path / "launcher.py"), str(tmp_path), SPAWNER])
    try:
        wait_until(lambda: (tmp_path / "all").exists() or launcher.poll() is not None, 20,
                   "the launcher to write its children's pids")
        assert launcher.poll() is None, "the launcher exited before starting its children"
        pids = read_pids(tmp_path / "all")  # 2 group leaders, 2 children, 2 grandchildren
        assert len(pids) == 6 and all(alive(p) for p in pids)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=scaled(10)) == (-sig if sig == signal.SIGKILL else 128 + sig)
        assert survivors(pids) == []
    finally:
        launcher.kill()
        launcher.wait()


# -- helpers ------------------------------------------------------------------------


def test_split_threads_examples():
    assert split_threads(2, cpu_count=8) == [4, 4]
    assert split_threads(3, cpu_count=8) == [3, 3, 2]
    assert split_threads(4, cpu_count=2) == [1, 1, 1, 1]
    assert split_threads(0, cpu_count=4) == []
    assert sum(split_threads(2)) >= 2
    with pytest.raises(ValueError, match="cpu_count must be >= 1"):
        split_threads(2, cpu_count=0)


@given(st.integers(1, 300), st.integers(1, 300))
def test_split_threads_is_fair(n, cpus):
    threads = split_threads(n, cpu_count=cpus)
    assert len(threads) == n and min(threads) >= 1
    assert sum(threads) == max(cpus, n)
    assert max(threads) - min(threads) <= 1


def test_rendezvous_env_uses_torchrun_names():
    assert rendezvous_env(1, 4, 29500) == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }
    assert rendezvous_env(1, 4, 29500, local_rank=0)["LOCAL_RANK"] == "0"
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        rendezvous_env(2, 2, 29500)


def test_a_free_port_is_held_for_the_server_it_is_meant_for():
    """Taken by a server that binds with SO_REUSEADDR (uvicorn, torch's TCPStore, vLLM all do), and by no one
    else meanwhile: a plain bind is refused and the kernel hands it to no one asking for any free port."""
    import errno
    import socket

    port = free_port()
    with socket.socket() as plain:
        with pytest.raises(OSError) as refused:
            plain.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
    picked = set()
    for _ in range(2000):
        with socket.socket() as any_port:
            any_port.bind(("127.0.0.1", 0))
            picked.add(any_port.getsockname()[1])
    assert port not in picked
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    assert len({free_port() for _ in range(50)}) == 50  # never the same port twice while held


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_two_ranks_rendezvous_with_gloo(tmp_path):
    rank = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        print("sum", t.item(), flush=True)
        dist.destroy_process_group()
        """
    )
    port = free_port()
    with Supervisor(tmp_path / "logs", term_timeout_s=2) as sup:
        ranks = [
            sup.start(ProcessSpec(f"actor-rank{r}", [PY, "-c", rank], env=rendezvous_env(r, 2, port), threads=1))
            for r in range(2)
        ]
        sup.watch(timeout_s=scaled(60))
    assert [m.tail()[-1] for m in ranks] == ["sum 2.0", "sum 2.0"]


def test_thread_plan_splits_cores_when_both_sides_run_at_once_and_gives_each_all_when_they_take_turns():
    from areal_core.processes.fleet import thread_plan

    assert thread_plan(1, 1, eta=4, cpu_count=2) == ([1], [1])
    assert thread_plan(1, 2, eta=1, cpu_count=8) == ([3], [3, 2])
    assert thread_plan(1, 1, eta=0, cpu_count=2) == ([2], [2])  # synchronous: generate, then train
    assert thread_plan(2, 2, eta=0, cpu_count=8) == ([4, 4], [4, 4])
    assert thread_plan(0, 1, eta=0, cpu_count=2) == ([], [2])


def test_the_resume_command_is_the_one_that_started_the_run_with_resume():
    from areal_core.processes.follow import resume_command

    assert resume_command(["/venv/bin/areal", "run", "my run.yaml", "trial=a b", "actor.optimizer.lr=1e-5"]) == \
        "areal run 'my run.yaml' 'trial=a b' actor.optimizer.lr=1e-5 --resume"
    assert resume_command(["areal", "run", "c.yaml", "--resume"]) == "areal run c.yaml --resume"
    assert resume_command(["python", "my_script.py"]).startswith("areal run CONFIG [key=value ...] --resume")
