"""The ``local`` launcher: every process of a run on this machine.

Inference servers first (engines that run their own server process, see
:meth:`areal_core.api.InferenceEngine.server_process`), each waited for with
its own timeout; then the train ranks, ``python -m areal_core.trainer``,
with a torch.distributed rendezvous on 127.0.0.1. Cores are split between
all of them (``OMP_NUM_THREADS`` and friends) so processes do not fight over
them; at ``max_head_offpolicyness: 0``, where generation and training take
turns, each side gets every core (:func:`thread_plan`). The launcher shows a live progress bar from the run's metrics, and on
exit, Ctrl-C, SIGTERM or a crash it stops every process it started (see
:mod:`areal_core.launch.supervisor`); a crash is reported with the process's
own last log lines.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from areal_core.api import Context, Launcher
from areal_core.launch.supervisor import (
    Managed, ProcessFailed, ProcessSpec, Shutdown, Supervisor, describe_exit, free_port, rendezvous_env,
    split_threads,
)
from areal_core.rollout.elastic import EVENTS_FILE, LAUNCHER_DISCOVERY_ENV, write_discovery_file
from areal_core.server_guard import ensure_run_token

console = Console(stderr=True, highlight=False, markup=False, soft_wrap=True, emoji=False)


def thread_plan(n_servers: int, world_size: int, eta: int, cpu_count: int | None = None) -> tuple[list[int], list[int]]:
    """Threads for each inference server and each train rank on this machine.

    With ``eta`` > 0 generation and training run at the same time, so every
    process gets its own share of the cores. At ``eta`` = 0 they take turns
    (a batch is generated, then trained on, then the next is generated), so
    the servers share all the cores among themselves and so do the train
    ranks: a synchronous run uses the whole machine in each phase instead of
    leaving half of it idle, which is the honest baseline for what the
    asynchronous mode gains.
    """
    if eta == 0:
        return split_threads(n_servers, cpu_count), split_threads(world_size, cpu_count)
    threads = split_threads(n_servers + world_size, cpu_count)
    return threads[:n_servers], threads[n_servers:]


class MetricsTail:
    """Follows ``metrics.jsonl`` and feeds the progress display (the trainers' output goes to log files).

    The trainer may rewrite the file on resume (dropping steps after the
    checkpoint), so a replaced or shorter file is read again from the start.
    Evaluations of steps up to ``announced_until`` (a resumed run's
    checkpoint step: the earlier run's rows) are shown on the bar but not
    announced again. A display problem is never allowed to stop the run.
    """

    def __init__(self, run_dir: Path, total: int, announced_until: int = -1) -> None:
        from areal_core.metrics import ProgressDisplay

        self.path = run_dir / "metrics.jsonl"
        self.identity: tuple[int, int] | None = None
        self.offset = 0
        self.display = ProgressDisplay(total, {"reward": "reward/mean", "accuracy": "eval/accuracy",
                                               "staleness": "staleness/token_lag_mean",
                                               "gen tok/s": "throughput/gen_tokens_per_s",
                                               "train tok/s": "throughput/train_tokens_per_s"})
        self.last_eval: dict = {}
        self.announced_until = announced_until
        # A resumed run's file as it was at launch: rows there come from the earlier run, also those after the
        # checkpoint that the trainer is about to drop.
        self.earlier: tuple[tuple[int, int], int] | None = None
        if announced_until >= 0 and self.path.exists():
            stat = self.path.stat()
            self.earlier = ((stat.st_ino, stat.st_dev), stat.st_size)
        # Servers that left or joined routing (the trainer's rows): only this run's, shown as they come.
        self.events_path = run_dir / EVENTS_FILE
        self.events_offset = self.events_path.stat().st_size if self.events_path.exists() else 0
        # The trainer's warnings for the terminal (a tracker switched off, ...): this run's, each once.
        from areal_core.metrics import WARNINGS_FILE

        self.warnings_path = run_dir / WARNINGS_FILE
        self.warnings_offset = self.warnings_path.stat().st_size if self.warnings_path.exists() else 0
        self._say_lock = threading.Lock()

    def poll(self) -> bool:
        try:
            self._read_new_rows()
        except (OSError, ValueError):
            pass  # a half-written or replaced file: read again next time
        try:
            self._read_new_events()
        except (OSError, ValueError):
            pass
        try:
            if self.warnings_path.exists():
                for self.warnings_offset, line in _complete_lines(self.warnings_path, self.warnings_offset):
                    self.say(f"warning: {json.loads(line)['message']}")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return False

    def _read_new_events(self) -> None:
        if not self.events_path.exists():
            return
        for self.events_offset, line in _complete_lines(self.events_path, self.events_offset):
            row = json.loads(line)
            self.say(f"inference server {row['server']} {row['event']}"
                     f"{' routing' if row['event'] in ('left', 'joined') else ''} at step {row.get('step', '?')}"
                     f": {row.get('why', '')}")

    def say(self, line: str) -> None:
        """One line above the bar (or alone when stderr is not a terminal); any thread may call it."""
        with self._say_lock:
            progress = getattr(self.display, "_progress", None)
            if progress is not None:
                progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=sys.stderr, flush=True)

    def _read_new_rows(self) -> None:
        if not self.path.exists():
            return
        stat = self.path.stat()
        if (stat.st_ino, stat.st_dev) != self.identity or stat.st_size < self.offset:
            self.identity, self.offset = (stat.st_ino, stat.st_dev), 0
        for self.offset, line in _complete_lines(self.path, self.offset):
            row = json.loads(line)
            if "eval/accuracy" in row:
                self.last_eval = {k: v for k, v in row.items() if k.startswith("eval/")}
                earlier = self.earlier is not None and self.identity == self.earlier[0] \
                    and self.offset <= self.earlier[1]
                if row["step"] > self.announced_until and not earlier:
                    self._say_eval(row)
            self.display.update(row["step"] - 1, {**self.last_eval, **row})  # accuracy stays shown

    def _say_eval(self, row: dict) -> None:
        """One line per evaluation, above the bar (or alone when stderr is not a terminal)."""
        after = int(row.get("eval/after_step", row["step"]))
        when = "before training" if after == 0 else f"after step {after}"
        line = (f"eval {when}: accuracy {row['eval/accuracy']:.3f} on {int(row.get('eval/items', 0))} "
                f"validation items")
        if row.get("eval/reward_mean") is not None:
            line += f", mean reward {row['eval/reward_mean']:.3f}"
        self.say(line)

    def close(self) -> None:
        self.display.close()


def _complete_lines(path: Path, offset: int) -> Iterator[tuple[int, bytes]]:
    """The lines of ``path`` after byte ``offset`` that a writer has finished (newline-ended), each with the
    offset just past it; a half-written last line waits for the next call."""
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith(b"\n"):
                return
            offset += len(line)
            yield offset, line


class ServerKeeper:
    """Restarts inference servers that exit during a run, within a budget (``rollout.elastic`` on).

    The trainer's health monitor drops a dead server from routing and its
    requests continue on the others; this side starts a replacement (a new
    port, so a late answer of the old one can never be taken for the new
    one's), waits for it with the engine's own startup timeout, and lists it
    in ``discovery_file``, from which the trainer's monitor adds it: it is
    brought to the current weights and joins at the next rebuild. The file
    lists only the restarted servers alive now, so one that died again is
    never re-added. ``budget`` restarts in all; past it a dead server is only
    dropped and the run goes on with the servers left (it stops when none is
    left: the trainer says so).
    """

    def __init__(self, sup: Supervisor, make: Callable[[int, int], Any], budget: int, discovery_file: Path,
                 say: Callable[[str], None], threads: dict[int, int]) -> None:
        self.sup, self.make, self.budget, self.say, self.threads = sup, make, budget, say, threads
        self.discovery_file = Path(discovery_file)
        # process name -> (server index, port); a restart is entered before it starts, so that an exit at once
        # is still known for a server's
        self.servers: dict[str, tuple[int, int]] = {}
        self.listed: dict[str, str] = {}  # process name -> address: the restarted servers that are up
        self.used = 0
        self._lock = threading.Lock()
        self._write()

    def track(self, name: str, index: int, port: int) -> None:
        self.servers[name] = (index, port)

    def on_exit(self, managed: Managed) -> bool:
        """Supervisor.watch's hook: True (taken care of) for a server, False for anything else."""
        if managed.name not in self.servers:
            return False
        index, port = self.servers[managed.name]
        with self._lock:
            self.listed.pop(managed.name, None)
            self._write()
            left = self.budget - self.used
            if left > 0:
                self.used += 1
                number = self.used
        what = f"{managed.name} (127.0.0.1:{port}) {describe_exit(managed.returncode, managed.oom_kills)}"
        if left <= 0:
            self.say(f"{what}; no restarts left (rollout.elastic.restarts={self.budget}), so the run goes on with "
                     f"the other inference servers; its log: {managed.log_path}")
            return True
        self.say(f"{what}; its requests continue on the other inference servers; restarting it (restart "
                 f"{number} of {self.budget}, rollout.elastic.restarts); its log: {managed.log_path}")
        threading.Thread(target=self._restart, args=(index, number), name=f"restart-rollout-{index}",
                         daemon=True).start()
        return True

    def _restart(self, index: int, number: int) -> None:
        port = free_port()
        server = self.make(index, port)
        name = f"rollout-{index}-restart{number}"
        self.track(name, index, port)
        try:
            managed = self.sup.start(ProcessSpec(name, server.argv, env=server.env, threads=self.threads.get(index)))
        except (RuntimeError, OSError) as exc:  # the run is being stopped, or the command cannot start
            self.say(f"rollout-{index} was not restarted: {exc}")
            return
        try:
            self.sup.wait_ready(managed, server.ready, server.startup_timeout_s, server.what)
        except ProcessFailed:
            return  # it ended: on_exit has it (another restart while the budget lasts)
        except TimeoutError as exc:
            self.say(f"restart {number} of rollout-{index} did not come up: {exc}")
            managed.kill()  # its exit goes to on_exit like any other
            return
        with self._lock:
            if managed.poll() is None:
                self.listed[name] = f"127.0.0.1:{port}"
                self._write()
        self.say(f"rollout-{index} is back on 127.0.0.1:{port} (restart {number} of {self.budget}); it rejoins "
                 f"routing with the current weights at the next rebuild (rollout.elastic.cooldown_s)")

    def _write(self) -> None:
        write_discovery_file(self.discovery_file, self.listed.values())


class InferenceServers:
    """The inference servers of a run's allocation that run as processes of their own on this machine (engines
    whose :meth:`~areal_core.api.InferenceEngine.server_process` gives one; the others live in the process that
    uses them), each on a free port of 127.0.0.1. ``areal run`` (the local launcher) and ``areal eval`` start
    them through this class, so a server is started one way only."""

    def __init__(self, run: Any) -> None:
        cfg, placement, engine_cls = run.config, run.placement("rollout"), run.components["rollout"]
        self.make: Callable[[int, int], Any] = lambda i, port: engine_cls.server_process(
            Context(config=cfg, options=run.options.get("rollout"), placement=placement), i, port)
        self.ports = [free_port() for _ in range(placement.parallel.d)]
        made = [self.make(i, port) for i, port in enumerate(self.ports)]
        self.servers = [(i, s) for i, s in enumerate(made) if s is not None]

    def start(self, sup: Supervisor, threads: list[int], keeper: ServerKeeper | None = None,
              prefix: str = "rollout") -> dict[int, str]:
        """Start every server (``threads[j]`` for the j-th), then wait for each with its own startup timeout;
        returns each server's address by index (``ProcessFailed`` or ``TimeoutError`` when one does not come
        up). Their logs are ``sup.log_dir/<prefix>-<index>.log``."""
        started, addresses = [], {}
        for (i, server), n in zip(self.servers, threads):
            managed = sup.start(ProcessSpec(f"{prefix}-{i}", server.argv, env=server.env, threads=n))
            started.append((managed, server))
            addresses[i] = f"127.0.0.1:{self.ports[i]}"
            if keeper is not None:
                keeper.track(managed.name, i, self.ports[i])
        for managed, server in started:
            sup.wait_ready(managed, server.ready, server.startup_timeout_s, server.what)
        return addresses


class LocalLauncher(Launcher):
    def launch(self, run: Any, run_dir: Path, *, resume: bool = False) -> int:
        run_dir = Path(run_dir)
        cfg = run.config
        actor = run.placement("actor")
        ensure_run_token()  # before any process starts: servers and trainer ranks inherit it
        inference = InferenceServers(run)
        servers = inference.servers
        server_threads, rank_threads = thread_plan(len(servers), actor.world_size, cfg.rollout.max_head_offpolicyness)
        master_port = free_port()
        restored_step = checkpoint_step(run_dir, verified=False) if resume else -1
        progress = MetricsTail(run_dir, cfg.trainer.total_steps, restored_step)
        try:
            with Supervisor(run_dir / "logs") as sup:
                sup.install_signal_handlers()
                addresses = {}
                keeper = None
                if cfg.rollout.elastic.enabled and servers:
                    keeper = ServerKeeper(
                        sup, inference.make, cfg.rollout.elastic.restarts, run_dir / "restarted-servers.txt",
                        progress.say, {i: n for (i, _), n in zip(servers, server_threads)})
                    addresses[LAUNCHER_DISCOVERY_ENV] = str(keeper.discovery_file)
                for i, address in inference.start(sup, server_threads, keeper).items():
                    addresses[f"AREAL_ROLLOUT_{i}_ADDRESS"] = address
                ranks = []
                for rank, n in zip(range(actor.world_size), rank_threads):
                    argv = [sys.executable, "-m", "areal_core.trainer", str(run_dir)] + (["--resume"] if resume else [])
                    env = {**rendezvous_env(rank, actor.world_size, master_port), **addresses,
                           "PYTHONUNBUFFERED": "1"}
                    ranks.append(sup.start(ProcessSpec(f"actor-rank{rank}", argv, env=env, threads=n)))
                # With rollout.elastic on, a server that exits is dropped by the trainer and restarted here; any
                # other process that fails stops the run.
                sup.watch(until=lambda: progress.poll() or all(r.poll() == 0 for r in ranks),
                          on_exit=keeper.on_exit if keeper is not None else None)
                progress.poll()
        except ProcessFailed as exc:
            progress.close()
            return report_failure(str(exc), run_dir)
        except Shutdown as exc:
            progress.close()
            console.print(f"areal run stopped ({exc}); every process it started was stopped. "
                          f"Continue with: {resume_command()}", highlight=False, markup=False)
            return exc.exit_code
        except KeyboardInterrupt:
            progress.close()
            console.print(f"areal run interrupted; every process it started was stopped. Continue with: "
                          f"{resume_command()}", highlight=False, markup=False)
            return 130
        except TimeoutError as exc:
            progress.close()
            console.print(f"areal run failed: {exc}")
            return 1
        progress.close()
        console.print(f"areal run finished: {run_dir}")
        return 0


def resume_command(argv: list[str] | None = None) -> str:
    """The command that continues this run: ``areal`` with the arguments this process was given (``argv``,
    default ``sys.argv``), plus ``--resume``, quoted for a POSIX shell. When this process was not started as
    ``areal run ...`` (a script calling a launcher), the general form."""
    import shlex

    args = list(sys.argv if argv is None else argv)[1:]
    if args[:1] != ["run"]:
        return "areal run CONFIG [key=value ...] --resume (the command that started the run)"
    return shlex.join(["areal", *args, *([] if "--resume" in args else ["--resume"])])


def report_failure(message: str, run_dir: Path) -> int:
    """Say that the run failed and, when a checkpoint is complete, how to continue from it; the exit status (1).
    Every launcher ends a failed run with these words."""
    console.print(f"areal run failed: {message}")
    saved = checkpoint_step(run_dir)
    if saved > 0:
        console.print(f"The checkpoint of step {saved} is complete and verifies: continue from it with: "
                      f"{resume_command()}", highlight=False, markup=False)
    return 1


def checkpoint_step(run_dir: Path, verified: bool = True) -> int:
    """The step of the run's newest checkpoint that verifies against its manifest; 0 when there is none (or none
    can be read): the step ``--resume`` continues from. ``verified=False``: of the newest complete one, without
    reading its files (where the step only starts a progress bar: the trainer verifies before it loads)."""
    from areal_core.checkpoint import CheckpointDamagedError, CheckpointStore

    store = CheckpointStore(run_dir / "checkpoints")
    try:
        found = store.resumable()[0] if verified else store.latest()
        return int(store.load_meta(found)["step"]) if found is not None else 0
    except (OSError, ValueError, KeyError, TypeError, CheckpointDamagedError):
        return 0
