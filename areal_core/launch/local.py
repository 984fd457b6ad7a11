"""The ``local`` launcher: every process of a run on this machine.

Inference servers first (engines that run their own server process, see
:meth:`areal_core.api.InferenceEngine.server_process`), each waited for with
its own timeout; then the train ranks, ``python -m areal_core.trainer``,
with a torch.distributed rendezvous on 127.0.0.1. Cores are split between
all of them (``OMP_NUM_THREADS`` and friends) so processes do not fight over
them; at ``max_head_offpolicyness: 0``, where generation and training take
turns, each side gets every core (:func:`thread_plan`). The launcher shows a live progress bar from the run's metrics, and on
exit, Ctrl-C, SIGTERM or a crash it stops every process it started (see
:mod:`areal_core.processes.supervisor`); a crash is reported with the process's
own last log lines.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from areal_core.api import Launcher
# the machinery every launcher shares lives in areal_core.processes; these names stay importable from here for
# plugins written against them
from areal_core.processes.fleet import InferenceServers, ServerKeeper, thread_plan  # noqa: F401
from areal_core.processes.follow import (MetricsTail, checkpoint_step, console, report_failure,  # noqa: F401
                                         resume_command)
from areal_core.processes.supervisor import ProcessFailed, ProcessSpec, Shutdown, Supervisor, free_port, rendezvous_env
from areal_core.rollout.elastic import LAUNCHER_DISCOVERY_ENV
from areal_core.server_guard import ensure_run_token


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
