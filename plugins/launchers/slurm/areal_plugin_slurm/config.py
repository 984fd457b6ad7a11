"""The slurm launcher's options (``launcher:`` in the run config) and the checks on them.

Stdlib only: the hook module imports this on every ``areal`` call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# What `sbatch --time` accepts: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
TIME_FORMAT = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)

# sbatch options the launcher writes itself (from the allocation, or from an option of its own).
OWN_DIRECTIVES = {
    "nodes": "the allocation and launcher.gpus_per_node", "N": "the allocation and launcher.gpus_per_node",
    "ntasks": "the allocation", "n": "the allocation", "ntasks-per-node": "the allocation",
    "gpus-per-node": "launcher.gpus_per_node", "output": "the run folder (logs/)", "o": "the run folder (logs/)",
    "error": "the run folder (logs/)", "e": "the run folder (logs/)", "parsable": "the launcher",
    "job-name": "launcher.job_name", "J": "launcher.job_name", "partition": "launcher.partition",
    "p": "launcher.partition", "account": "launcher.account", "A": "launcher.account", "time": "launcher.time",
    "t": "launcher.time", "qos": "launcher.qos", "q": "launcher.qos", "cpus-per-task": "launcher.cpus_per_task",
    "c": "launcher.cpus_per_task",
}


@dataclass
class SlurmConfig:
    """Keys of ``launcher`` when ``launcher.name: slurm``."""

    partition: str = field(default="", metadata={"help": "#SBATCH --partition; '' = the cluster's default"})
    account: str = field(default="", metadata={"help": "#SBATCH --account to charge; '' = your default account"})
    time: str = field(default="", metadata={
        "help": "#SBATCH --time, the job's time limit: minutes, HH:MM:SS or D-HH:MM:SS (24:00:00); "
                "'' = the partition's default"})
    qos: str = field(default="", metadata={"help": "#SBATCH --qos; '' = the default quality of service"})
    job_name: str = field(default="", metadata={"help": "#SBATCH --job-name; '' = areal-<experiment>-<trial>"})
    sbatch_lines: list[str] = field(default_factory=list, metadata={
        "help": "more #SBATCH options, one per item, e.g. ['--exclusive', '--mem=0', '--constraint=a100'] "
                "(the '#SBATCH ' prefix is optional)"})
    gpus_per_node: int = field(default=8, metadata={
        "ge": 1, "help": "GPUs on each node of the partition: how many ranks and servers share a node "
                         "(#SBATCH --gpus-per-node); unused when the allocation is on cpu"})
    nodes: int = field(default=0, metadata={
        "ge": 0, "help": "the most nodes the job may take: a split that needs more is refused before anything is "
                         "submitted (so `areal plan` picks among those that fit); 0 = as many as it needs"})
    cpus_per_task: int = field(default=0, metadata={
        "ge": 0, "help": "CPUs for each server and train rank (--cpus-per-task, and their thread count); "
                         "0 = the cluster's default (threads: the CPUs SLURM binds each task to)"})
    setup: list[str] = field(default_factory=list, metadata={
        "help": "shell lines run on the node before each step, e.g. ['module load cuda/12.4', "
                "'source ~/venvs/areal/bin/activate']; a failing line fails the step"})
    python: str = field(default="", metadata={
        "help": "the Python interpreter on the nodes, with areal and the same plugins installed; "
                "'' = the one running `areal run` (shared storage or the same image on every node)"})
    host: str = field(default="", metadata={
        "help": "the address servers and the trainer rendezvous listen on; '' = each node's own address "
                "(resolved from its name); 127.0.0.1 only works on one node"})
    dry_run: bool = field(default=False, metadata={
        "help": "print the batch scripts and where they would be written, submit nothing (areal run --dry-run)"})
    poll_s: float = field(default=5.0, metadata={"gt": 0.0, "help": "seconds between looks at the job (squeue)"})
    submit_timeout_s: float = field(default=60.0, metadata={
        "gt": 0.0, "help": "how long sbatch, squeue and scancel may take to answer"})
    step_wait_timeout_s: float = field(default=1800.0, metadata={
        "gt": 0.0, "help": "how long a step waits for another's files: the check for every node's report, the "
                           "train ranks for each server's address (keep it above the inference engine's startup "
                           "timeout: the wait starts with the servers) and rank 0's rendezvous"})
    cancel_timeout_s: float = field(default=120.0, metadata={
        "gt": 0.0, "help": "after scancel (Ctrl-C, SIGTERM), how long to wait for the job to leave the queue"})


def option_problems(options: SlurmConfig) -> list[tuple[str, str, str]]:
    """(key, message, fix) for every option sbatch or the shell would misread; [] when all are fine."""
    out = []
    if options.time and not TIME_FORMAT.fullmatch(options.time):
        out.append(("launcher.time", f"{options.time!r} is not a SLURM time limit",
                    "write minutes, HH:MM:SS or D-HH:MM:SS, e.g. launcher.time=24:00:00 (or '' for the partition's "
                    "default)"))
    for key in ("partition", "account", "qos", "job_name", "host"):
        value = getattr(options, key)
        if value and not re.fullmatch(r"[^\s'\"\\$`]+", value):
            out.append((f"launcher.{key}", f"{value!r} holds a space, quote or shell character",
                        f"set launcher.{key} to a single word (e.g. the name `sinfo` or `sacctmgr` shows)"))
    if options.python and "\n" in options.python:
        out.append(("launcher.python", f"{options.python!r} holds a line break", "give one interpreter path"))
    for i, line in enumerate(options.sbatch_lines):
        option = sbatch_option(line)
        key = f"launcher.sbatch_lines[{i}]"
        if "\n" in line or not option.startswith("-"):
            out.append((key, f"{line!r} is not one sbatch option",
                        "write one option per item, e.g. '--exclusive' or '--mem=0' ('#SBATCH ' in front is "
                        "optional)"))
            continue
        name = re.split(r"[= ]", option.lstrip("-"), maxsplit=1)[0]
        if name in OWN_DIRECTIVES:
            out.append((key, f"{line!r} sets --{name}, which the launcher writes itself from "
                             f"{OWN_DIRECTIVES[name]}", f"remove it from launcher.sbatch_lines and set "
                                                        f"{OWN_DIRECTIVES[name]} instead"))
    return out


def sbatch_option(line: str) -> str:
    """The option of an sbatch line, without the optional '#SBATCH' in front."""
    text = line.strip()
    if text.upper().startswith("#SBATCH"):
        text = text[len("#SBATCH"):].strip()
    return text


def options_from(raw: dict[str, Any]) -> SlurmConfig:
    """The options as the core would build them from ``launcher.extra`` (bad values are left at defaults: the
    core reports them)."""
    from areal_core.config.load import build

    scratch: list = []
    built = build(SlurmConfig, dict(raw), "launcher.", scratch)
    return built if built is not None else SlurmConfig()
