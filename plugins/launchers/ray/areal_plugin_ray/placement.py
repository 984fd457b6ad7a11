"""From a validated allocation to a Ray placement group: one bundle per process, and which process goes where.

The allocation says how many inference servers and train ranks a run has and
on what devices (``vllm:d2t2+fsdp:d4``: two servers of two GPUs each, four
train ranks of one GPU; ``@cpu``: no GPU; ``|``: components that share their
devices). Ray places each bundle on a node that has its resources, so the
nodes a run lands on are Ray's choice, made once for the whole run (the
placement group is reserved before any process starts, or not at all).

Colocated groups (``vllm:d2|fsdp:d2``) get one bundle per inference server,
holding that server's GPUs and the CPUs of every process that shares them;
the server's actor takes the GPUs and the train ranks on the same devices
are placed in the same bundle and given the same devices
(``CUDA_VISIBLE_DEVICES``), which is what colocation means. (Ray cannot
give two actors the same whole GPU, hence this rather than a GPU request
per rank.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Slot:
    """One process of the run and the bundle it goes in."""

    name: str  # "rollout-0", "actor-rank1": the same names as the local launcher's
    role: str  # "rollout" or "actor"
    index: int  # server index or rank
    bundle: int
    cpus: int
    gpus: float  # what the actor asks of its bundle
    shares_devices_with: str | None = None  # colocated: the server whose GPUs it uses


@dataclass
class Plan:
    bundles: list[dict[str, float]] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)

    def role(self, role: str) -> list[Slot]:
        return [s for s in self.slots if s.role == role]

    def describe(self) -> str:
        return ", ".join(f"{s.name}: {_resources(self.bundles[s.bundle])}" for s in self.slots)


def _resources(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def plan(allocation: Any, rollout: Any, actor: Any, servers: int, server_cpus: int, rank_cpus: int) -> Plan:
    """The bundles and slots of a run whose inference servers (``servers`` of them; 0 for an engine that runs
    inside the trainer) and train ranks are the allocation components ``rollout`` and ``actor``."""
    result = Plan()
    colocated = any(rollout in group and actor in group for group in allocation.groups)
    gpus_per_server = rollout.n_devices // max(rollout.parallel.d, 1) if rollout.device == "gpu" else 0
    gpus_per_rank = 1 if actor.device == "gpu" else 0
    if colocated and servers:
        ranks_per_server = -(-actor.world_size // servers)
        for i in range(servers):
            ranks = [r for r in range(actor.world_size) if r // ranks_per_server == i]
            result.bundles.append({"CPU": float(server_cpus + rank_cpus * len(ranks)),
                                   **({"GPU": float(gpus_per_server)} if gpus_per_server else {})})
            result.slots.append(Slot(f"rollout-{i}", "rollout", i, i, server_cpus, gpus_per_server))
            for r in ranks:
                result.slots.append(Slot(f"actor-rank{r}", "actor", r, i, rank_cpus, 0, f"rollout-{i}"))
        result.slots.sort(key=lambda s: (s.role != "rollout", s.index))
        return result
    for i in range(servers):
        result.bundles.append({"CPU": float(server_cpus), **({"GPU": float(gpus_per_server)} if gpus_per_server else {})})
        result.slots.append(Slot(f"rollout-{i}", "rollout", i, len(result.bundles) - 1, server_cpus, gpus_per_server))
    for r in range(actor.world_size):
        result.bundles.append({"CPU": float(rank_cpus), **({"GPU": float(gpus_per_rank)} if gpus_per_rank else {})})
        result.slots.append(Slot(f"actor-rank{r}", "actor", r, len(result.bundles) - 1, rank_cpus, gpus_per_rank))
    return result


def local_ranks(nodes: list[str]) -> list[tuple[int, int]]:
    """Each train rank's (local rank, ranks on its node), from the node each rank landed on (in rank order)."""
    seen: dict[str, int] = {}
    local = []
    for node in nodes:
        local.append(seen.get(node, 0))
        seen[node] = seen.get(node, 0) + 1
    return [(lr, seen[node]) for lr, node in zip(local, nodes)]
