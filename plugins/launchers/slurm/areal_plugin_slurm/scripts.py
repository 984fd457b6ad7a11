"""The batch script (``job.sbatch``) and the per-task step script (``step.sh``) of a run, as text.

One job, three srun steps, in order: ``check`` (one task per node: same
plugins as the launcher's machine, shared storage), then ``servers`` and
``train`` side by side. Steps run in the background and the script waits for
the first to end (``wait -n``, with a polling fallback for bash < 4.3): the train step ending well ends
the job; any step failing, or the servers ending first, stops the other step
(SIGTERM to its srun, which passes it to its tasks; SIGKILL after a grace)
and fails the job. ``scancel``, the time limit or a preemption (SIGTERM to
the script) stops both. How the job ended goes to ``slurm/status.json``
before anything is stopped, so the launcher can say which step failed and
with what status.
"""

from __future__ import annotations

import shlex
from typing import Any

from areal_plugin_slurm.config import SlurmConfig, sbatch_option
from areal_plugin_slurm.files import Paths
from areal_plugin_slurm.layout import Layout, Step

GRACE_S = 30  # a step's workers stop their processes within 10 s of SIGTERM (the supervisor's grace)

WHAT = {"check": "one task per node: the same areal plugins as the launcher's machine, and shared storage",
        "servers": "the inference servers (their logs: logs/rollout-<i>.log)",
        "train": "the train ranks (their logs: logs/actor-rank<r>.log)"}


def directives(options: SlurmConfig, layout: Layout, paths: Paths, job_name: str) -> list[str]:
    """The ``#SBATCH`` lines: what the allocation needs, then the user's options, then their extra lines."""
    lines = [f"--job-name={job_name}", f"--nodes={layout.nodes}", f"--ntasks-per-node={layout.tasks_per_node}"]
    if layout.gpus_per_node:
        lines.append(f"--gpus-per-node={layout.gpus_per_node}")
    if options.cpus_per_task:
        lines.append(f"--cpus-per-task={options.cpus_per_task}")
    for key in ("partition", "account", "time", "qos"):
        if getattr(options, key):
            lines.append(f"--{key}={getattr(options, key)}")
    lines.append(f"--output={paths.logs / 'slurm-job-%j.log'}")
    lines += [sbatch_option(line) for line in options.sbatch_lines]
    return [f"#SBATCH {line}" for line in lines]


def _srun(step: Step, options: SlurmConfig, paths: Paths) -> str:
    opts = step.srun_options(options.cpus_per_task)
    log = f'--output="$LOGS/slurm-{step.name}-%t.log"'
    return f'srun {" ".join(opts)} {log} bash "$SLURM_DIR/step.sh" {step.name} &'


def batch_script(options: SlurmConfig, layout: Layout, paths: Paths, job_name: str, version: str) -> str:
    q = shlex.quote
    steps = [s for s in (layout.check, layout.servers, layout.train) if s is not None]
    summary = "\n".join(f"#   {s.name:<8}{s.tasks} task(s) on {s.nodes} node(s): {WHAT[s.name]}" for s in steps)
    head = "\n".join(["#!/bin/bash", *directives(options, layout, paths, job_name)])
    servers = layout.servers is not None
    body = f"""
#
# areal run in {paths.run_dir}
# written by areal-plugin-slurm {version} (launcher.name=slurm); `areal run` submitted it and follows it.
# Steps, in order:
{summary}
# The first step to fail (or the servers ending before training did) stops the other; how the job ended
# goes to slurm/status.json.

set -u
RUN_DIR={q(str(paths.run_dir))}
SLURM_DIR="$RUN_DIR/slurm"
LOGS="$RUN_DIR/logs"
GRACE_S={GRACE_S}
export AREAL_SLURM_RUN_DIR="$RUN_DIR"
FINAL=""
RUNNING=()

record() {{  # record STATE [STEP CODE]: how the job stands, for `areal run` (one JSON object, replaced at once)
  local tmp="$SLURM_DIR/.status.$$"
  printf '{{"job": "%s", "state": "%s", "step": "%s", "code": %s}}\\n' "$SLURM_JOB_ID" "$1" "${{2:-}}" "${{3:-0}}" \\
    > "$tmp" && mv -f "$tmp" "$SLURM_DIR/status.json"
}}

stop() {{  # stop PID...: SIGTERM each srun (it passes the signal to its tasks), SIGKILL after GRACE_S
  local pid ticks=0
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "$@"; do
    while kill -0 "$pid" 2>/dev/null && [ "$ticks" -lt $((GRACE_S * 10)) ]; do sleep 0.1; ticks=$((ticks + 1)); done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
}}

on_signal() {{  # scancel, the time limit or a preemption: stop every step, say so, leave
  trap '' TERM INT HUP
  [ -n "$FINAL" ] || record cancelled "" "$1"
  echo "areal: job $SLURM_JOB_ID received signal $1; stopping its steps"
  stop ${{RUNNING[@]+"${{RUNNING[@]}}"}}  # (an empty array under set -u, before bash 4.4)
  exit $((128 + $1))
}}
trap 'on_signal 15' TERM
trap 'on_signal 2' INT
trap 'on_signal 1' HUP

rm -rf "$SLURM_DIR/addresses" "$SLURM_DIR/train" "$SLURM_DIR/check" "$SLURM_DIR/failures"
mkdir -p "$LOGS" "$SLURM_DIR/addresses" "$SLURM_DIR/train" "$SLURM_DIR/check" "$SLURM_DIR/failures"
record running
echo "areal: job $SLURM_JOB_ID started on ${{SLURM_JOB_NODELIST:-?}}; step check"

{_srun(layout.check, options, paths)}
RUNNING=($!)
wait "${{RUNNING[0]}}"
code=$?
if [ "$code" -ne 0 ]; then
  FINAL=1
  record failed check "$code"
  echo "areal: step check failed (exit status $code); no server or train rank was started"
  exit "$code"
fi
"""
    if servers:
        body += f"""
echo "areal: check passed; steps servers and train"
{_srun(layout.servers, options, paths)}
SERVERS=$!
{_srun(layout.train, options, paths)}
TRAIN=$!
RUNNING=("$SERVERS" "$TRAIN")
# The first of the two steps to end: `wait -n` (bash >= 4.3), then a poll that also covers older bash.
wait -n 2>/dev/null
while kill -0 "$SERVERS" 2>/dev/null && kill -0 "$TRAIN" 2>/dev/null; do sleep 1 & wait $!; done
if ! kill -0 "$TRAIN" 2>/dev/null; then wait "$TRAIN"; code=$?; first=train; other=$SERVERS
else wait "$SERVERS"; code=$?; first=servers; other=$TRAIN; fi
"""
    else:
        body += f"""
echo "areal: check passed; step train (the inference engine runs inside the trainer: no servers step)"
{_srun(layout.train, options, paths)}
TRAIN=$!
RUNNING=("$TRAIN")
wait "$TRAIN"
code=$?
first=train
other=""
"""
    body += """
FINAL=1
if [ "$first" = train ] && [ "$code" -eq 0 ]; then
  record completed
  echo "areal: training finished${other:+; stopping the inference servers}"
  [ -z "$other" ] || stop "$other"
  exit 0
fi
record failed "$first" "$code"
echo "areal: step $first ended with exit status $code before training finished; stopping the job"
[ -z "$other" ] || stop "$other"
[ "$code" -ne 0 ] || code=1
exit "$code"
"""
    return head + body


def step_script(options: SlurmConfig, paths: Paths, python: str) -> str:
    """What each task of a step runs: the setup lines, then the worker (``python -m areal_plugin_slurm.step``)."""
    q = shlex.quote
    setup = "\n".join(options.setup) if options.setup else "# (no launcher.setup lines)"
    return f"""#!/bin/bash
# One task of a step of the areal run in {paths.run_dir} (the job: job.sbatch beside this file).
# Usage: step.sh check|servers|train. The launcher.setup lines run first; one that fails fails the task.
set -e
trap 'rc=$?; echo "areal: on ${{SLURMD_NODENAME:-$(hostname)}}, launcher.setup line \\`$BASH_COMMAND\\` failed with exit status $rc in step $1. Fix: correct launcher.setup" >&2' ERR
{setup}
trap - ERR
set +e
if ! command -v {q(python)} >/dev/null 2>&1; then
  echo "areal: on ${{SLURMD_NODENAME:-$(hostname)}}, the interpreter {python} (launcher.python) is not there. Fix: set launcher.python to the Python that has areal installed on the nodes, or add the line that provides it (module load, source .../activate) to launcher.setup" >&2
  exit 127
fi
exec {q(python)} -m areal_plugin_slurm.step "$1" {q(str(paths.run_dir))}
"""


def plan(run: Any, layout: Layout, options: SlurmConfig, paths: Paths, resume: bool,
         plugins: dict[str, str]) -> dict:
    """What every step reads (``slurm/plan.json``): the reference plugin set, counts, timeouts."""
    import socket

    return {"run_dir": str(paths.run_dir), "resume": resume, "plugins": plugins,
            "launcher_host": socket.gethostname(), "nodes": layout.nodes,
            "servers": layout.servers.tasks if layout.servers else 0, "world_size": layout.train.tasks,
            "host": options.host, "cpus_per_task": options.cpus_per_task,
            "wait_timeout_s": options.step_wait_timeout_s}
