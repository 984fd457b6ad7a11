"""The ``slurm`` launcher: a whole run as one SLURM batch job, submitted and followed from `areal run`.

``areal run CONFIG launcher.name=slurm`` (on a login node) writes the job
under ``<run_dir>/slurm/`` (``job.sbatch``, ``step.sh``, ``plan.json``),
submits it with ``sbatch --parsable``, and follows it like the local
launcher follows its processes: the same progress bar from the run's
metrics, Ctrl-C / SIGTERM cancel the job (``scancel``) and wait until it is
gone, a failure names the step and quotes its log, and the exit status is
the local launcher's (0, 1, 128 + signal). The job's layout comes from the
validated allocation (:mod:`areal_plugin_slurm.layout`), its scripts from
:mod:`areal_plugin_slurm.scripts`, and each task runs
:mod:`areal_plugin_slurm.step`.
"""

from __future__ import annotations

import json
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console

from areal_core.api import Context, Launcher
from areal_core.problems import Problem, ProblemsError

from areal_plugin_slurm import slurm
from areal_plugin_slurm.config import SlurmConfig
from areal_plugin_slurm.files import Paths, write_atomic
from areal_plugin_slurm.layout import Layout, LayoutError, plan_layout
from areal_plugin_slurm.scripts import batch_script, plan, step_script

console = Console(stderr=True, highlight=False, markup=False, soft_wrap=True, emoji=False)
DISTRIBUTION = "areal-plugin-slurm"


def _version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def layout_for(run: Any, options: SlurmConfig) -> Layout:
    """The job's layout for a validated run; servers only when the inference engine runs its own."""
    rollout, actor = run.placement("rollout"), run.placement("actor")
    probe = run.components["rollout"].server_process(
        Context(config=run.config, options=run.options.get("rollout"), placement=rollout,
                extras={"host": "127.0.0.1"}), 0, 0)
    return plan_layout(run.allocation, rollout, actor, options.gpus_per_node, with_servers=probe is not None)


class SlurmLauncher(Launcher):
    """Submits the run as one batch job (check, servers, train steps) and follows it to its end."""

    config_class = SlurmConfig

    @classmethod
    def create(cls, context: Context) -> SlurmLauncher:
        """Refuses, before `areal run` makes the run folder, on a machine without SLURM's commands."""
        options = context.options or SlurmConfig()
        missing = [] if options.dry_run else slurm.missing_commands()
        if missing:
            message, fix = slurm.missing_message(missing)
            raise ProblemsError([Problem("slurm.no-sbatch", message, fix, key="launcher.name")],
                                source="the slurm launcher")
        return cls(context)

    @property
    def options(self) -> SlurmConfig:
        return self.context.options or SlurmConfig()

    def launch(self, run: Any, run_dir: Path, *, resume: bool = False) -> int:
        from areal_core.server_guard import ensure_run_token

        options, paths = self.options, Paths(Path(run_dir).resolve())
        cfg = run.config
        ensure_run_token()  # sbatch passes this process's environment on to the job (--export=ALL, its default)
        try:
            layout = layout_for(run, options)
        except LayoutError as exc:
            console.print(f"areal run: {exc}")
            return 1
        from areal_core.processes.nodes import installed_plugins

        job_name = options.job_name or f"areal-{cfg.experiment}-{cfg.trial}"
        python = options.python or sys.executable
        files = {paths.batch: batch_script(options, layout, paths, job_name, _version()),
                 paths.step: step_script(options, paths, python),
                 paths.plan: json.dumps(plan(run, layout, options, paths, resume, installed_plugins()), indent=2)
                 + "\n"}
        if options.dry_run:
            return _dry_run(files, paths, layout)
        missing = slurm.missing_commands()
        if missing:  # create() checks too; this is for a launcher built some other way
            message, fix = slurm.missing_message(missing)
            console.print(f"areal run: {message}. Fix: {fix}. Nothing was submitted.")
            return 1
        if cfg.rollout.elastic.enabled:
            console.print("note: rollout.elastic is on, but the slurm launcher does not restart inference servers: "
                          "a server that exits ends the job (the local launcher restarts them)")
        still_queued = _earlier_job_in_queue(paths, options)
        if still_queued:
            console.print(f"areal run: SLURM job {still_queued}, started earlier for this run folder, is still in the "
                          f"queue ({paths.run_dir}); two jobs would write the same checkpoints. Fix: wait for it to "
                          f"end, or cancel it (scancel {still_queued}), then run this command again. Nothing was "
                          f"submitted.")
            return 1
        paths.logs.mkdir(parents=True, exist_ok=True)  # sbatch --output needs the folder to exist
        for stale in paths.per_job():
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        for path, text in files.items():
            write_atomic(path, text)
        paths.step.chmod(0o755)
        return self._submit_and_follow(paths, layout, options, cfg, resume, job_name)

    def _submit_and_follow(self, paths: Paths, layout: Layout, options: SlurmConfig, cfg: Any, resume: bool,
                           job_name: str) -> int:
        from areal_core.processes.follow import MetricsTail, checkpoint_step, report_failure, resume_command

        from areal_plugin_slurm.follow import Follower, follow, signals_raise_shutdown

        try:
            with signals_raise_shutdown():
                job = slurm.submit(paths.batch, paths.run_dir, options.submit_timeout_s)
        except slurm.SlurmCommandError as exc:
            console.print(f"areal run: {exc}")
            return 1
        except KeyboardInterrupt as exc:  # Shutdown (SIGTERM, SIGINT, SIGHUP) included
            console.print(f"areal run stopped while sbatch was submitting {paths.batch}; the job may have been "
                          f"submitted: look for it with `squeue --me --name={job_name}` and cancel it with scancel")
            return getattr(exc, "exit_code", 130)
        write_atomic(paths.job_id, job + "\n")
        console.print(f"submitted SLURM job {job}: {layout.describe()}\n"
                      f"  logs: {paths.logs}/ (the job's own: {paths.job_log(job).name}; each step task's: "
                      f"slurm-<step>-<task>.log; servers: rollout-<i>.log; train ranks: actor-rank<r>.log)\n"
                      f"  scripts: {paths.slurm}/; Ctrl-C here cancels the job (scancel {job})")
        saved = checkpoint_step(paths.run_dir, verified=False) if resume else -1
        progress = MetricsTail(paths.run_dir, cfg.trainer.total_steps, saved)
        follower = Follower(paths, job, options, progress.say, progress.poll)
        try:
            how, status = follow(follower)
            progress.poll()
        finally:
            progress.close()
        if how == "stopped":
            state = "was cancelled and has left the queue" if status["gone"] else \
                f"was cancelled, but may still be stopping (squeue -j {job}; scancel {job} again if it stays)"
            console.print(f"areal run stopped ({status['why']}); SLURM job {job} {state}. "
                          f"Continue with: {resume_command()}", highlight=False, markup=False)
            return int(status["code"])
        if status is not None and status.get("state") == "completed":
            console.print(f"areal run finished: {paths.run_dir} (SLURM job {job})")
            return 0
        return report_failure(follower.failure(status), paths.run_dir)


def _earlier_job_in_queue(paths: Paths, options: SlurmConfig) -> str | None:
    """The id of this run folder's previous job when SLURM still lists it (a cancel that timed out, say)."""
    try:
        job = paths.job_id.read_text().strip()
    except OSError:
        return None
    try:
        return None if not job or slurm.job_state(job, options.submit_timeout_s).gone else job
    except slurm.SlurmCommandError:
        return None  # cannot tell; sbatch will say if SLURM is down


def _dry_run(files: dict[Path, str], paths: Paths, layout: Layout) -> int:
    """Print what would be written and submitted; write nothing (the run folder is not even created)."""
    out = [f"dry run (launcher.dry_run): nothing was written or submitted. The job: {layout.describe()}.",
           f"`areal run` without --dry-run writes these files under {paths.slurm}/ and submits the first with "
           f"`sbatch --parsable {paths.batch}`:"]
    for path, text in files.items():
        out += ["", f"==> {path} <==", text.rstrip("\n")]
    print("\n".join(out), flush=True)
    return 0
