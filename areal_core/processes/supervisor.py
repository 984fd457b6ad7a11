"""Start a run's processes on one machine, watch them, and leave none behind.

Engine-agnostic and stdlib only: the ``local`` launcher builds a
:class:`ProcessSpec` per inference server and per train rank, and a
:class:`Supervisor` does the rest::

    with Supervisor(run_dir / "logs") as sup:
        sup.install_signal_handlers()            # SIGTERM/SIGHUP/SIGINT -> Shutdown
        server = sup.start(ProcessSpec("rollout-0", argv, threads=2))
        sup.wait_ready(server, healthy, timeout_s=300, what="the health endpoint")
        port = free_port()
        for r in range(2):
            sup.start(ProcessSpec(f"actor-rank{r}", train_argv, env=rendezvous_env(r, 2, port)))
        sup.watch()                               # returns when every process exited 0
    # leaving the block (normally, by an exception, Ctrl-C or SIGTERM) stops everything

How teardown works, case by case (Linux; ``tests/test_supervisor.py`` proves each):

- Each process starts as the leader of a new session, so it and everything it
  starts share one process group; :meth:`Supervisor.stop_all` sends SIGTERM to
  each group, waits ``term_timeout_s``, then SIGKILLs each group and (on Linux)
  returns only once no member is left running, so GPU memory and ports are
  free. Leaving the ``with`` block always calls it; a second Ctrl-C during the
  wait skips to SIGKILL. A failure seen by :meth:`Supervisor.watch` calls it too.
- A launcher stopped by SIGTERM, SIGHUP or SIGINT: the handlers from
  :meth:`Supervisor.install_signal_handlers` raise :class:`Shutdown`, the
  ``with`` block exits, and the above runs.
- A launcher killed by SIGKILL (or the out-of-memory killer) runs nothing. On
  Linux each command therefore runs under a small trampoline
  (``areal_core/processes/child.py``, about 10 MB per process) that asks the
  kernel for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``) and then
  tears down its whole process group, grandchildren included, SIGKILLing it
  after ``term_timeout_s``. Setting the death signal and ``exec``-ing the
  command instead is not enough: the request does not survive ``fork``, and
  measured, the command died but its own children (``sleep``) kept running.
  ``preexec_fn`` is not used because it is unsafe in a process with threads.
- A process that ends by itself: the trampoline SIGTERMs whatever it left
  behind in its group, then exits with the command's own status.

Limits, honestly: a descendant that leaves its process group (``setsid``,
daemonizing) escapes every case above; on macOS and other non-Linux systems
there is no trampoline, so a SIGKILLed launcher leaves its children running.
The kernel sends the death signal when the *thread* that started a process
exits, not only the process: the trampoline ignores it while the launcher is
still alive, so starting processes from a short-lived thread is harmless.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen
from types import FrameType, TracebackType

log = logging.getLogger("areal.launch")

_TRAMPOLINE = Path(__file__).with_name("child.py")
_LINUX = sys.platform.startswith("linux")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
_SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_REAP_TIMEOUT_S = 5.0  # after SIGKILL only a process stuck in the kernel takes longer


PROCESS_NAME_ENV = "AREAL_PROCESS_NAME"


@dataclass
class ProcessSpec:
    """One process of a run: what to execute and in which environment."""

    name: str  # "rollout-0", "actor-rank1": names the log file and every error about it
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added on top of os.environ
    cwd: str | None = None
    threads: int | None = None  # OMP/MKL/OpenBLAS thread counts; `env` wins where both set one


def split_threads(n_processes: int, cpu_count: int | None = None) -> list[int]:
    """Share ``cpu_count`` cores (default: those this process may use) fairly.

    Each process gets at least one thread, counts differ by at most one, and
    they sum to ``max(cpu_count, n_processes)``; the first ones get the remainder.
    """
    if n_processes < 0:
        raise ValueError(f"n_processes must be >= 0, got {n_processes}")
    if cpu_count is None:
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cpu_count < 1:
        raise ValueError(f"cpu_count must be >= 1, got {cpu_count}")
    if n_processes == 0:
        return []
    base, extra = divmod(max(cpu_count, n_processes), n_processes)
    return [base + (i < extra) for i in range(n_processes)]


# Ports handed out by free_port, each held by a bound socket that never listens (see free_port): (when, socket)
_HELD_PORTS: collections.deque = collections.deque()
_HELD_LOCK = threading.Lock()
PORT_HOLD_S = 600.0  # how long a handed-out port stays held: longer than any server takes to start


def _release_held_ports() -> None:
    with _HELD_LOCK:
        while _HELD_PORTS:
            _HELD_PORTS.popleft()[1].close()


atexit.register(_release_held_ports)  # closed, not left to the interpreter's teardown (a ResourceWarning each)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``, held for this process for :data:`PORT_HOLD_S` seconds.

    A port picked and then left free for a server or rank 0 to bind seconds later was taken in between by
    another process often enough to fail a run under load (``EADDRINUSE`` at the torch rendezvous of a test's
    run while other tests started servers). So the picking socket stays bound, with ``SO_REUSEADDR`` and
    without listening: the kernel gives the port to no one asking it for a free port, and refuses it to a plain
    ``bind``, while the servers and ranks it is meant for, which all bind with ``SO_REUSEADDR`` (uvicorn,
    torch's TCPStore, vLLM), take it as usual. No library does this (``portpicker`` has no hold), hence here.
    The socket is not inherited by children (PEP 446) and closes at the latest when this process ends."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        port = s.getsockname()[1]
    except BaseException:
        s.close()
        raise
    now = time.monotonic()
    with _HELD_LOCK:
        while _HELD_PORTS and now - _HELD_PORTS[0][0] > PORT_HOLD_S:
            _HELD_PORTS.popleft()[1].close()
        _HELD_PORTS.append((now, s))
    return port


def rendezvous_env(rank: int, world_size: int, master_port: int, local_rank: int | None = None) -> dict[str, str]:
    """torchrun's variables for one rank of a single-machine ``init_process_group(init_method="env://")``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def oom_kill_count(root: str | os.PathLike[str] = "/sys/fs/cgroup") -> int | None:
    """How many processes of this process's cgroup (and those below it) the kernel's out-of-memory killer has
    killed, from the cgroup's own counter: ``oom_kill`` in ``memory.events`` (cgroup v2) or
    ``memory.oom_control`` (v1). None where neither can be read (no cgroup file system, no memory controller)."""
    root = Path(root)
    candidates: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        path = path.lstrip("/")
        if controllers == "":  # v2
            candidates += [root / path / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):  # v1
            candidates += [root / "memory" / path / "memory.oom_control", root / "memory" / "memory.oom_control"]
    for file in candidates:
        try:
            for line in file.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
        except OSError:
            continue
    return None


def describe_exit(returncode: int, oom_kills: tuple[int | None, int | None] = (None, None)) -> str:
    """How a process ended, for messages: "exited with code 3", "was killed by signal 9 (SIGKILL) (...)".

    For SIGKILL, ``oom_kills`` (the cgroup's :func:`oom_kill_count` when the process started and when it ended)
    tells the kernel's out-of-memory killer from a kill sent from outside; without both it says it cannot tell.
    """
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    hint = ""
    if returncode == -signal.SIGKILL:
        before, after = oom_kills
        if before is not None and after is not None and after > before:
            hint = (f" by the kernel's out-of-memory killer (this cgroup's oom_kill counter went from {before} to "
                    f"{after} meanwhile): it ran out of memory")
        elif before is not None and after is not None:
            hint = (f" from outside the run: no process of this cgroup was killed for memory meanwhile (its "
                    f"oom_kill counter stayed at {after})")
        else:
            hint = (" (sent by another process, or by the kernel's out-of-memory killer: this machine's cgroup "
                    "counters, which would tell, cannot be read; the kernel log would say)")
    return f"was killed by signal {-returncode} ({name}){hint}"


def read_tail(log_path: Path, n: int = 20) -> list[str]:
    """The last ``n`` lines of a log file, reading only its end; [] when it does not exist."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * n - 4096))
            data = f.read()
    except FileNotFoundError:
        return []
    return data.decode(errors="replace").splitlines()[-n:] if n > 0 else []


def format_tail(log_path: Path | None, log_tail: list[str]) -> str:
    if not log_tail:
        return f"; its log {log_path} is empty" if log_path else ""
    where = f" of {log_path}" if log_path else ""
    return f"; last {len(log_tail)} lines{where}:\n" + "\n".join(f"    {line}" for line in log_tail)


class ProcessFailed(RuntimeError):
    """A supervised process exited unsuccessfully; the message names it, how it ended and its last log lines."""

    def __init__(
        self, name: str, returncode: int, log_tail: list[str], log_path: Path | None = None, context: str = "",
        oom_kills: tuple[int | None, int | None] = (None, None),
    ) -> None:
        self.name, self.returncode, self.log_tail, self.log_path = name, returncode, log_tail, log_path
        super().__init__(f"{name} {describe_exit(returncode, oom_kills)}{context}{format_tail(log_path, log_tail)}")


class Shutdown(KeyboardInterrupt):
    """The launcher received a termination signal; raised so ``with Supervisor(...)`` tears down."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell convention for death by this signal: 128 + its number."""
        return 128 + self.signum


class Managed:
    """A started process: its spec, its log, and how it ended (``poll()``).

    Where the OS allows, an ended process stays a zombie until ``stop_all`` reaps
    it, so its process-group id cannot be reused; ``popen.returncode`` is
    therefore None until then, and ``poll()`` is the status to read.
    """

    def __init__(self, spec: ProcessSpec, popen: Popen, log_path: Path) -> None:
        self.name, self.spec, self.popen, self.log_path = spec.name, spec, popen, log_path
        self.returncode: int | None = None  # set by the exit watcher; negative: killed by that signal
        # the cgroup's out-of-memory kill counter when it started and when it ended (the watcher reads it)
        self.oom_kills: tuple[int | None, int | None] = (oom_kill_count(), None)
        self.exited = threading.Event()
        self.reaped = False

    @property
    def pid(self) -> int:
        """The process-group leader (on Linux the trampoline that runs ``spec.argv``)."""
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit status once the process has ended, else None. Use this, not ``popen.poll()``."""
        return self.returncode

    def kill(self) -> None:
        """SIGKILL its whole process group now (its exit is then seen like any other)."""
        _signal_group(self, signal.SIGKILL)

    def tail(self, n: int = 20) -> list[str]:
        """The last ``n`` lines of its log (stdout and stderr together)."""
        return read_tail(self.log_path, n)

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else describe_exit(self.returncode, self.oom_kills)
        return f"<Managed {self.name} pid={self.pid} {state}>"


def _watch_exit(managed: Managed, on_exit: Callable[[Managed], None]) -> None:
    """Block until ``managed`` exits; record its status without reaping it where the OS allows.

    The unreaped leader keeps its pid, hence its process-group id, from being
    reused, so a later ``killpg`` can only reach that group's own leftovers.
    """
    pid = managed.popen.pid
    if hasattr(os, "waitid"):
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        managed.returncode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    else:
        managed.returncode = managed.popen.wait()
        managed.reaped = True
    managed.oom_kills = (managed.oom_kills[0], oom_kill_count())
    on_exit(managed)
    managed.exited.set()


def _signal_group(managed: Managed, sig: int) -> None:
    try:
        os.killpg(managed.popen.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is empty (or only a zombie is left)
        pass


class Supervisor:
    """Starts processes, watches them, and stops all of them when its ``with`` block ends."""

    def __init__(self, log_dir: Path, *, term_timeout_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.term_timeout_s = term_timeout_s
        self.processes: list[Managed] = []
        self._exit_order: list[Managed] = []  # in the order they ended: the first failure is the cause
        self._changed = threading.Event()
        self._previous_handlers: dict[int, object] = {}
        self._lock = threading.Lock()  # start() may run on another thread (a restart) while stop_all() runs
        self._stopping = False
        self._handled: set[int] = set()  # ids of exited processes an ``on_exit`` hook took care of
        self._offered = 0  # how many of _exit_order were offered to the hook

    # -- starting ---------------------------------------------------------

    def start(self, spec: ProcessSpec) -> Managed:
        """Start ``spec`` in a new session; stdout and stderr go to ``log_dir/<name>.log``.

        Safe to call from another thread while :meth:`watch` runs; once :meth:`stop_all` has begun it refuses
        (RuntimeError), so nothing started late outlives the teardown.
        """
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"not starting {spec.name}: the supervisor is stopping every process")
            return self._start(spec)

    def _start(self, spec: ProcessSpec) -> Managed:
        if any(m.name == spec.name for m in self.processes):
            raise ValueError(f"a process named {spec.name!r} was already started; names must be unique")
        if not spec.argv:
            raise ValueError(f"{spec.name}: argv is empty")
        if spec.threads is not None and spec.threads < 1:
            raise ValueError(f"{spec.name}: threads must be >= 1, got {spec.threads}")
        threads = {} if spec.threads is None else {v: str(spec.threads) for v in _THREAD_VARS}
        # PROCESS_NAME_ENV lets a process (and a test or operator reading /proc/PID/environ) know which of the
        # run's processes it is, whatever order the pids came in.
        env = {**os.environ, **threads, **spec.env, PROCESS_NAME_ENV: spec.name}
        _check_executable(spec, env)
        argv = list(spec.argv)
        if _LINUX:
            # -I -S: the trampoline is stdlib only; no site, user paths or PYTHON* settings slow or break it
            trampoline = [sys.executable, "-I", "-S", str(_TRAMPOLINE), str(os.getpid()), str(self.term_timeout_s)]
            argv = [*trampoline, "--", *argv]
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "wb") as out:
            out.write(f"$ {shlex.join(spec.argv)}\n".encode())
            out.flush()
            popen = Popen(
                argv, stdin=DEVNULL, stdout=out, stderr=STDOUT, env=env, cwd=spec.cwd, start_new_session=True
            )
        managed = Managed(spec, popen, log_path)
        self.processes.append(managed)
        watcher = threading.Thread(target=_watch_exit, args=(managed, self._on_exit), name=f"watch-{spec.name}")
        watcher.daemon = True
        watcher.start()
        log.info("started %s (pid %d), log %s", spec.name, popen.pid, log_path)
        return managed

    def _on_exit(self, managed: Managed) -> None:
        self._exit_order.append(managed)
        self._changed.set()

    # -- waiting ----------------------------------------------------------

    def wait_ready(self, managed: Managed, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``check()`` until it returns True.

        An ``OSError`` from ``check`` (connection refused, ...) counts as not ready
        yet; any other exception propagates. ``check`` must return quickly.
        Raises ProcessFailed if the process ends first (even with code 0) and
        TimeoutError, naming ``what`` and quoting the log, after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        last_error = ""
        while True:
            try:
                if check():
                    return
            except OSError as e:
                last_error = f"; the last check failed with {type(e).__name__}: {e}"
            if managed.returncode is not None:
                raise self._failure(managed, context=f" before {what} was ready")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                tail = managed.tail()
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for {what} ({managed.name}, pid {managed.pid}, still running)"
                    f"{last_error}{format_tail(managed.log_path, tail)}"
                )
            managed.exited.wait(min(0.1, remaining))

    def watch(
        self, poll_s: float = 0.2, until: Callable[[], bool] | None = None, timeout_s: float | None = None,
        on_exit: Callable[[Managed], bool] | None = None,
    ) -> None:
        """Block until every process has exited 0, or ``until()`` is True.

        The first process to fail (in the order they ended) stops all the others
        and is raised as ProcessFailed; failures are checked before ``until``, so
        ``until=lambda: trainer.poll() is not None`` returns only on success.
        ``on_exit``, when given, is offered every process that ends (once, in
        the order they ended, on this thread) before that check: returning True
        takes care of it (an expendable server that is restarted), and it is
        then neither a failure nor waited for. With ``timeout_s`` set,
        TimeoutError names the processes still running.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            ended = list(self._exit_order)
            if on_exit is not None:
                for m in ended[self._offered:]:
                    if on_exit(m):
                        self._handled.add(id(m))
                self._offered = len(ended)
            failed = next((m for m in ended if m.returncode != 0 and id(m) not in self._handled), None)
            if failed is not None:
                self.stop_all()
                raise self._failure(failed)
            if all(m.returncode == 0 or id(m) in self._handled for m in list(self.processes)):
                return
            if until is not None and until():
                return
            if deadline is not None and time.monotonic() >= deadline:
                running = ", ".join(m.name for m in self.processes if m.returncode is None)
                raise TimeoutError(f"waited {timeout_s:.0f} s for every process to finish; still running: {running}")
            self._changed.wait(poll_s)

    def _failure(self, managed: Managed, context: str = "") -> ProcessFailed:
        return ProcessFailed(managed.name, managed.returncode, managed.tail(), managed.log_path, context,
                             managed.oom_kills)

    # -- stopping ---------------------------------------------------------

    def stop_all(self) -> None:
        """SIGTERM every process group, wait up to ``term_timeout_s``, SIGKILL them all, reap.

        Idempotent. A KeyboardInterrupt (a second Ctrl-C) during the grace period
        skips straight to SIGKILL; the teardown still completes.
        """
        with self._lock:
            self._stopping = True
        running = [m for m in self.processes if m.returncode is None]
        try:
            if running:
                log.info("stopping %s", ", ".join(m.name for m in running))
            for m in running:
                _signal_group(m, signal.SIGTERM)
            deadline = time.monotonic() + self.term_timeout_s
            for m in running:
                m.exited.wait(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            log.warning("interrupted again: killing %s now", ", ".join(m.name for m in running))
        finally:
            self._kill_and_reap()

    def _kill_and_reap(self) -> None:
        unreaped = [m for m in self.processes if not m.reaped]
        for m in unreaped:  # leftovers in a group whose leader already ended go too
            _signal_group(m, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        for m in unreaped:
            if not m.exited.wait(max(0.0, deadline - time.monotonic())):
                log.warning("%s (pid %d) survived SIGKILL for %.0f s; leaving it", m.name, m.pid, _REAP_TIMEOUT_S)
                continue
            m.popen.wait()  # reaps the zombie the exit watcher left
            m.reaped = True
        # SIGKILL is asynchronous: return only once the groups are empty (GPU memory freed, ports closed).
        groups = {m.pid for m in unreaped}
        while (left := _live_members(groups)) and time.monotonic() < deadline:
            time.sleep(0.02)
        if left:
            log.warning("processes %s survived SIGKILL for %.0f s; leaving them", sorted(left), _REAP_TIMEOUT_S)

    # -- the launcher's own signals ----------------------------------------

    def install_signal_handlers(self) -> Supervisor:
        """Turn SIGTERM, SIGHUP and SIGINT into :class:`Shutdown` so the ``with`` block tears down.

        Call from the main thread; the previous handlers come back when the block exits.
        """

        def raise_shutdown(signum: int, frame: FrameType | None) -> None:
            raise Shutdown(signum)

        for s in _SHUTDOWN_SIGNALS:
            self._previous_handlers.setdefault(s, signal.signal(s, raise_shutdown))
        return self

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop_all()
        finally:
            for s, handler in self._previous_handlers.items():
                signal.signal(s, handler)
            self._previous_handlers.clear()


def _live_members(groups: set[int]) -> set[int]:
    """Pids of running (not zombie) processes in these process groups; Linux only, else empty."""
    if not groups or not _LINUX:
        return set()
    members = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # it ended while we looked
            continue
        if int(pgrp) in groups and state != "Z":
            members.add(int(entry.name))
    return members


def _check_executable(spec: ProcessSpec, env: dict[str, str]) -> None:
    program = spec.argv[0]
    if os.sep in program:
        path = Path(spec.cwd or ".") / program
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"cannot start {spec.name}: {path} is not an executable file")
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(f"cannot start {spec.name}: {program!r} is not on its PATH")
