"""Run untrusted Python under limits; the host side of the sandbox.

Layers, each used where this machine allows it (:func:`isolation` says which):

- namespaces (``unshare``: user, mount, network, pid): no network device but
  a down loopback; a root of its own (``pivot_root`` into a tmpfs holding
  read-only binds of ``/usr`` and the Python installation, four devices, a
  ``/proc`` of its own pid namespace, and ``/box``: a tmpfs of ``disk_mb``,
  the only writable place), so no host file or process is visible; killing
  the namespace's first process kills every process in it, even ones that
  left the process group.
- a pids cgroup (v1 ``pids`` hierarchy or a writable v2 cgroup with the
  ``pids`` controller): a hard cap on processes that, unlike
  ``RLIMIT_NPROC``, counts only this run's processes and binds root too.
- rlimits in the child: CPU seconds, address space, file size, open files,
  no core dumps; ``RLIMIT_NPROC`` only when there is no cgroup (it counts
  every process of the user, so it is set to the user's current count plus
  the allowance, and root ignores it).
- always: its own session (``start_new_session``), a wall-clock bound, a
  fresh folder removed afterwards, a scrubbed environment, an audit hook
  refusing sockets and writes outside the folder.

The wall clock bounds programs that sleep or block. It starts when the program
does: the sandbox's own setup (namespaces, mounts, the interpreter's start),
which on a busy machine was seen to block for seconds in the kernel before a
line of the program ran, is bounded apart (:data:`SETUP_TIMEOUT_S`; the run
stage says on a pipe when it hands over to the program). It does not count the
time the sandbox waited for a CPU that the machine gave to other work (the longest
run-queue delay among its processes, ``/proc/PID/schedstat``, but no more than
the wall time they did not spend on a CPU), up to :data:`MAX_CPU_WAIT` times
``wall_s`` more. Without that, on a machine busy with a run's trainer and
inference servers a correct solution timed out and scored 0.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

RUNNER = str(Path(__file__).with_name("_runner.py"))
# what runs the first stage: ``python -I <these> setup|run CONFIG`` (the runner itself; tests put a double first)
RUNNER_ARGV = [RUNNER]
MARK = "areal-sandbox: blocked"
# The wall clock is extended by the time the sandbox waited for a CPU, by at most this many times wall_s: its
# processes can make one another wait only as long as their CPU seconds (cpu_s each) allow, and a machine so
# busy that a run waits longer than this is better told by timeouts than by an endless wait.
MAX_CPU_WAIT = 4.0
# How often the host looks at the sandbox's run-queue delay while it runs.
POLL_S = 0.1
# The most the sandbox's setup may take, before the program starts (then: sandbox_error, not the program's fault).
SETUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    file_size_mb: int = 16
    disk_mb: int = 64  # all a run may write (its /box tmpfs; namespaces mode)
    allow_weak_isolation: bool = False  # run without namespaces (rlimits and the audit hook only: no boundary)


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | error | timeout | cpu_time | memory | process_limit | file_size | disk_full | network | write_blocked | sandbox_error
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    cpu_wait_s: float = 0.0  # time the sandbox waited for a CPU, not counted against wall_s
    setup_s: float = 0.0  # from the start to the program's first line (namespaces, mounts, interpreter)


@functools.lru_cache(maxsize=1)
def isolation() -> str:
    """``namespaces`` where unprivileged user + mount + network + pid namespaces work, else ``rlimits``."""
    unshare = shutil.which("unshare")
    if unshare and sys.platform.startswith("linux"):
        try:
            done = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
                                   "--kill-child", "--", "true"], capture_output=True, timeout=10)
            if done.returncode == 0:
                return "namespaces"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "rlimits"


@functools.lru_cache(maxsize=1)
def pids_cgroup_root() -> str | None:
    """A folder where a child pids cgroup can be made, or None."""
    candidates = ["/sys/fs/cgroup/pids"]
    try:  # cgroup v2: our own cgroup, if it is writable and delegates pids
        own = Path("/proc/self/cgroup").read_text().splitlines()
        v2 = [line.split(":", 2)[2] for line in own if line.startswith("0::")]
        if v2:
            candidates.append("/sys/fs/cgroup" + v2[0].rstrip("/"))
    except OSError:
        pass
    for root in candidates:
        probe = Path(root) / f"areal-probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
            try:
                if (probe / "pids.max").exists():
                    return root
            finally:
                probe.rmdir()
        except OSError:
            continue
    return None


def _user_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _kill_cgroup(path: Path) -> None:
    for _ in range(100):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    try:
        path.rmdir()
    except OSError:
        pass


def _run_delay_s(pid: int) -> float:
    """Seconds process ``pid`` has been runnable but not running (the kernel's run-queue delay); 0 when the
    kernel does not say (no schedstat) or the process has gone."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _usage(session: int, cgroup: Path | None) -> tuple[float, float]:
    """(the longest run-queue delay, the CPU seconds used) among the sandbox's processes as the host sees them:
    those of its session (its first process's pid) and of its cgroup (which the code's process joins once set
    up, and which a process leaving the session stays in). Once the cgroup holds the code's processes, only
    they and the session's first are read; before, every process's stat is scanned for the session."""
    pids = {session}
    if cgroup is not None:
        try:
            pids.update(int(p) for p in (cgroup / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            pass
    candidates = pids.copy() if len(pids) > 1 else [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    cpu = 0.0
    for pid in candidates:
        try:
            # after the command's closing parenthesis: state, ppid, pgrp, session, ..., utime (11), stime (12)
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session or pid in pids:
                pids.add(pid)
                cpu += (int(fields[11]) + int(fields[12])) * TICK_S
        except (OSError, IndexError, ValueError):
            continue
    return max(_run_delay_s(pid) for pid in pids), cpu


@dataclass
class _Clock:
    """The sandbox's clocks while it runs: when the program started (None: still in setup), and the run-queue
    delay and CPU seconds its processes had then (what the program's own count starts from)."""

    spawned: float
    started: float | None = None
    delay0: float = 0.0
    cpu0: float = 0.0
    cpu_wait: float = 0.0


def _wait(proc: subprocess.Popen, stdin: bytes | None, limits: Limits, cgroup: Path | None,
          ready: int) -> tuple[str | None, _Clock]:
    """Wait for ``proc`` with ``stdin`` written to it: (None, or why it was stopped: "timeout" for the program's
    wall clock, "setup" for a setup that did not finish in :data:`SETUP_TIMEOUT_S`; the clocks). Hand-written
    because subprocess's timeout is plain wall time.

    The wall clock starts when the run stage writes to ``ready`` (the program's first line is next). What is not
    counted on it is the longest run-queue delay among the sandbox's processes since then, but never more than the
    wall time they did not spend on a CPU: processes of its own that keep one another waiting (a fork bomb) use
    the CPUs meanwhile, so their waits are the program's own, not the machine's."""
    clock = _Clock(time.monotonic())
    cap = MAX_CPU_WAIT * limits.wall_s
    while True:
        delay, cpu = _usage(proc.pid, cgroup)
        now = time.monotonic()
        if clock.started is None and _readable(ready):
            clock.started, clock.delay0, clock.cpu0 = now, delay, cpu
        if clock.started is None:
            left, why = clock.spawned + SETUP_TIMEOUT_S - now, "setup"
        else:
            ran = now - clock.started
            clock.cpu_wait = min(cap, max(clock.cpu_wait, min(delay - clock.delay0, ran - (cpu - clock.cpu0))))
            left, why = clock.started + limits.wall_s + clock.cpu_wait - now, "timeout"
        if left <= 0:
            return why, clock
        try:
            # the input goes with the first call only; a retry after a timeout goes on writing it
            proc.communicate(stdin, timeout=min(left, POLL_S))
            return None, clock
        except subprocess.TimeoutExpired:
            stdin = None


def _readable(fd: int) -> bool:
    """Whether ``fd`` has something to read, or its writer has closed it (the run stage's word, or its end)."""
    return bool(select.select([fd], [], [], 0)[0])


def _pids_max_hit(path: Path | None) -> bool:
    if path is None:
        return False
    try:
        for line in (path / "pids.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "max" and int(value) > 0:
                return True
    except OSError:
        pass
    return False


def _status(returncode: int | None, stderr: str, timed_out: bool, forks_refused: bool) -> str:
    if f"{MARK} network" in stderr:
        return "network"
    if f"{MARK} write" in stderr:
        return "write_blocked"
    if "areal-sandbox: setup failed" in stderr:
        return "sandbox_error"
    if forks_refused or "BlockingIOError" in stderr and "fork" in stderr:
        return "process_limit"
    if "MemoryError" in stderr:
        return "memory"
    if timed_out:
        return "timeout"
    if "areal-sandbox: cpu time limit" in stderr or returncode in (-signal.SIGXCPU, 152):
        return "cpu_time"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_size"
    if "No space left on device" in stderr:
        return "disk_full"
    if "Read-only file system" in stderr:
        return "write_blocked"
    return "ok" if returncode == 0 else "error"


WEAK = ("this machine gives no unprivileged user, mount, network and pid namespaces (`unshare --user "
        "--map-root-user --mount --net --pid` fails), so untrusted code would run with rlimits and an audit hook "
        "only, which Python code can reach around; it is not run. Fix: run where unprivileged user namespaces are "
        "enabled (sysctl kernel.unprivileged_userns_clone=1; a container runtime that allows them), or set "
        "reward.allow_weak_isolation=true to accept the weaker guard")


def root_binds() -> list[str]:
    """What the sandbox's own root shows of the host, read-only: the system's programs and libraries (and the
    links to them at the top level), the dynamic linker's cache, and this interpreter's installation."""
    binds = ["/usr", "/etc/ld.so.cache", "/etc/alternatives"]
    binds += [f"/{name}" for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
              if os.path.lexists(f"/{name}")]
    for prefix in {sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}:
        if not any(prefix == b or prefix.startswith(b + "/") for b in binds):
            binds.append(prefix)
    return binds


def run_python(source: str, stdin: str = "", limits: Limits = Limits(), max_output: int = 1 << 20) -> Outcome:
    """Run ``source`` as ``main.py`` with ``stdin`` under ``limits``; never raises for what the code does."""
    mode = isolation()
    if mode != "namespaces" and not limits.allow_weak_isolation:
        return Outcome("sandbox_error", None, "", f"areal-sandbox: {WEAK}", 0.0)
    work = Path(tempfile.mkdtemp(prefix="areal-sandbox-"))
    box = work / "box"
    box.mkdir()
    (work / "root").mkdir()
    (box / "main.py").write_text(source)
    cgroup: Path | None = None
    root = pids_cgroup_root()
    if root is not None:
        cgroup = Path(root) / f"areal-sandbox-{uuid.uuid4().hex}"
        try:
            cgroup.mkdir()
            (cgroup / "pids.max").write_text(str(limits.max_processes))
        except OSError:
            cgroup = None
    cfg = {"box": str(box), "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20,
           "file_bytes": limits.file_size_mb << 20, "cgroup": str(cgroup) if cgroup else "",
           "unshare": shutil.which("unshare") or "", "root": str(work / "root"), "binds": root_binds(),
           "python": os.path.realpath(sys.executable), "disk_bytes": limits.disk_mb << 20}
    # the run stage writes one byte here just before the program's first line, and closes it: the wall clock's start
    ready, cfg["ready_fd"] = os.pipe()
    if cgroup is None:
        cfg["nproc"] = _user_process_count() + limits.max_processes
    if mode == "namespaces":
        cmd = [cfg["unshare"], "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
               "--kill-child", "--", sys.executable, "-I", *RUNNER_ARGV, "setup", json.dumps(cfg)]
    else:
        if cgroup is not None:  # no setup stage to join it: the child joins before running the code
            cmd = [sys.executable, "-I", "-c",
                   "import sys,runpy;open(sys.argv[2]+'/cgroup.procs','w').write('0');"
                   "sys.argv=[sys.argv[1],'run',sys.argv[3]];runpy.run_path(sys.argv[0],run_name='__main__')",
                   RUNNER, str(cgroup), json.dumps(cfg)]
        else:
            cmd = [sys.executable, "-I", *RUNNER_ARGV, "run", json.dumps(cfg)]
    seen = "/box" if mode == "namespaces" else str(box)  # the folder as the program sees it
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": seen, "TMPDIR": seen}
    start = time.monotonic()
    stopped, clock = None, _Clock(start)
    # Output goes to files, not pipes: RLIMIT_FSIZE then bounds it, and a flood cannot fill our memory.
    with open(work / "stdout", "w+b") as out, open(work / "stderr", "w+b") as err:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=box, env=env,
                                    start_new_session=True, pass_fds=(cfg["ready_fd"],))
        except OSError as exc:
            os.close(ready)
            os.close(cfg["ready_fd"])
            shutil.rmtree(work, ignore_errors=True)
            return Outcome("sandbox_error", None, "", f"could not start the sandbox: {exc}", 0.0)
        os.close(cfg["ready_fd"])  # the sandbox holds the only write end: its end reads as the pipe's end
        try:
            stopped, clock = _wait(proc, stdin.encode(), limits, cgroup, ready)
        except (BrokenPipeError, OSError):
            pass
        finally:
            os.close(ready)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the session: everything that stayed in its group
            except OSError:
                pass
            proc.wait()
            forks_refused = _pids_max_hit(cgroup)
            if cgroup is not None:
                _kill_cgroup(cgroup)  # the rest, wherever it went
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stdout = out.read(max_output).decode("utf-8", "replace")
        stderr = err.read(max_output).decode("utf-8", "replace")
    shutil.rmtree(work, ignore_errors=True)
    if stopped == "setup":
        stderr += (f"\nareal-sandbox: setup did not finish in {SETUP_TIMEOUT_S:g} s (namespaces, mounts, the "
                   f"interpreter's start): the machine, not the program\n")
    status = "sandbox_error" if stopped == "setup" else _status(proc.returncode, stderr, stopped == "timeout",
                                                                forks_refused)
    setup = (clock.started if clock.started is not None else time.monotonic()) - start
    return Outcome(status, proc.returncode, stdout, stderr, seconds, clock.cpu_wait, min(setup, seconds))
