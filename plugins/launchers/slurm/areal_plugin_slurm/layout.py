"""Where a run's processes go in one SLURM job: nodes, tasks and GPUs of each srun step, from the allocation.

The allocation says how many inference servers (``rollout``'s ``d``; each
uses its ``t*p*c`` GPUs) and train ranks (``actor``'s world size, one GPU
each) a run has, and which of them share devices (``|``) or not (``+``).
The job then needs:

- one node when everything fits on one (``launcher.gpus_per_node`` GPUs);
- otherwise, per group of the allocation, enough whole nodes for its largest
  component, groups on consecutive nodes (each step starts at its group's
  first node: ``srun --relative``, so groups never compete for a node's
  GPUs). A group on cpu takes no node of its own: it runs on the first.

Each step is ``--exact`` (it gets what it asks for and no more, so the
servers' and the trainers' steps run side by side); the train step is also
``--overlap`` when it shares its GPUs with the servers (``|``). Tasks are
spread evenly over a step's nodes. A server larger than a node is refused:
one server is one task on one node here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """The allocation cannot be placed as SLURM steps; ``key``, ``message`` and ``fix`` say why."""

    def __init__(self, key: str, message: str, fix: str) -> None:
        super().__init__(f"{key}: {message}. Fix: {fix}")
        self.key, self.message, self.fix = key, message, fix


@dataclass(frozen=True)
class Step:
    """One srun step: ``tasks`` copies of the worker on ``nodes`` nodes from the job's node ``first_node``."""

    name: str  # "check", "servers", "train"
    tasks: int
    nodes: int
    first_node: int
    tasks_per_node: int
    gpus_per_task: int = 0
    overlap: bool = False

    def srun_options(self, cpus_per_task: int) -> list[str]:
        opts = [f"--job-name={self.name}", f"--nodes={self.nodes}", f"--ntasks={self.tasks}",
                f"--ntasks-per-node={self.tasks_per_node}", f"--relative={self.first_node}", "--exact"]
        if self.gpus_per_task:
            opts.append(f"--gpus-per-task={self.gpus_per_task}")
        if cpus_per_task and self.name != "check":
            opts.append(f"--cpus-per-task={cpus_per_task}")
        if self.overlap:
            opts.append("--overlap")
        return opts + ["--kill-on-bad-exit=1"]


@dataclass(frozen=True)
class Layout:
    """The whole job: its node count, what it asks per node, and its steps."""

    nodes: int
    gpus_per_node: int  # requested per node; 0 on cpu
    tasks_per_node: int
    check: Step
    servers: Step | None
    train: Step

    def describe(self) -> str:
        steps = [s for s in (self.servers, self.train) if s is not None]
        parts = [f"{s.tasks} {'inference server' if s.name == 'servers' else 'train rank'}"
                 f"{'' if s.tasks == 1 else 's'} on node{'' if s.nodes == 1 else 's'} "
                 f"{_node_range(s)}" for s in steps]
        gpus = f", {self.gpus_per_node} GPU(s) per node" if self.gpus_per_node else ""
        return f"{self.nodes} node{'' if self.nodes == 1 else 's'}{gpus}: " + "; ".join(parts)


def _node_range(step: Step) -> str:
    last = step.first_node + step.nodes - 1
    return str(step.first_node) if last == step.first_node else f"{step.first_node}-{last}"


def _group_of(allocation: Any, component: Any) -> int:
    return next(i for i, group in enumerate(allocation.groups) if any(c is component for c in group))


def _spread(name: str, component: Any, tasks: int, gpus_per_task: int, gpus_per_node: int, what: str) -> Step:
    if gpus_per_task == 0:  # on cpu: every task on one node
        return Step(name, tasks, 1, 0, tasks)
    if gpus_per_task > gpus_per_node:
        raise LayoutError("allocation", f"'{component}': each {what} uses {gpus_per_task} GPUs, more than one node "
                                        f"has (launcher.gpus_per_node={gpus_per_node}); the slurm launcher runs "
                                        f"each {what} on one node",
                          f"use at most {gpus_per_node} GPUs per {what} (fewer t/p), or set launcher.gpus_per_node "
                          f"to the partition's GPUs per node")
    nodes = math.ceil(tasks / (gpus_per_node // gpus_per_task))
    return Step(name, tasks, nodes, 0, math.ceil(tasks / nodes), gpus_per_task)


def plan_layout(allocation: Any, rollout: Any, actor: Any, gpus_per_node: int, with_servers: bool) -> Layout:
    """The job for these placements (``run.placement("rollout")``, ``run.placement("actor")``); ``with_servers``
    is False for an inference engine that runs inside the trainer (no servers step)."""
    steps: list[tuple[Step, int]] = []  # (step, allocation group)
    if with_servers:
        per_server = rollout.n_devices // rollout.parallel.d
        steps.append((_spread("servers", rollout, rollout.parallel.d, per_server, gpus_per_node, "inference server"),
                      _group_of(allocation, rollout)))
    steps.append((_spread("train", actor, actor.world_size, 1 if actor.n_devices else 0, gpus_per_node,
                          "train rank"), _group_of(allocation, actor)))
    group_nodes: dict[int, int] = {}
    group_gpus: dict[int, int] = {}
    for step, group in steps:
        if step.gpus_per_task:
            group_nodes[group] = max(group_nodes.get(group, 0), step.nodes)
            group_gpus[group] = max(group_gpus.get(group, 0), step.tasks * step.gpus_per_task)
    one_node = sum(group_gpus.values()) <= gpus_per_node and all(s.nodes == 1 for s, _ in steps)
    first: dict[int, int] = {}
    if not one_node:
        offset = 0
        for group in sorted(group_nodes):
            first[group], offset = offset, offset + group_nodes[group]
    nodes = 1 if one_node else max(sum(group_nodes.values()), 1)
    placed = []
    for step, group in steps:
        shares = step.name == "train" and with_servers and group == steps[0][1] and step.gpus_per_task > 0
        placed.append(Step(step.name, step.tasks, step.nodes, first.get(group, 0), step.tasks_per_node,
                           step.gpus_per_task, overlap=shares))
    per_node = [sum(s.tasks_per_node for s in placed if s.first_node <= n < s.first_node + s.nodes)
                for n in range(nodes)]
    gpus = 0
    if group_gpus:
        gpus = sum(group_gpus.values()) if one_node else gpus_per_node
    check = Step("check", nodes, nodes, 0, 1)
    servers = placed[0] if with_servers else None
    return Layout(nodes, gpus, max(per_node + [1]), check, servers, placed[-1])
