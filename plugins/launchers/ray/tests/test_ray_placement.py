"""The placement group a run asks Ray for, derived from its allocation (no cluster needed)."""

from __future__ import annotations

from areal_core.config.allocation import parse_allocation
from areal_plugin_ray.placement import local_ranks, plan


def _plan(text: str, servers: int | None = None, server_cpus: int = 2, rank_cpus: int = 1):
    allocation = parse_allocation(text)
    rollout, actor = allocation.components
    return plan(allocation, rollout, actor, rollout.parallel.d if servers is None else servers, server_cpus, rank_cpus)


def test_one_bundle_per_process_with_its_gpus():
    p = _plan("vllm:d2t2+fsdp:d4")
    assert p.bundles == [{"CPU": 2.0, "GPU": 2.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert [(s.name, s.bundle, s.gpus) for s in p.slots] == [
        ("rollout-0", 0, 2), ("rollout-1", 1, 2),
        ("actor-rank0", 2, 1), ("actor-rank1", 3, 1), ("actor-rank2", 4, 1), ("actor-rank3", 5, 1)]


def test_cpu_components_ask_for_no_gpu():
    p = _plan("local:d2@cpu+fsdp:d1@cpu")
    assert p.bundles == [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}]
    assert all(s.gpus == 0 for s in p.slots)


def test_an_engine_inside_the_trainer_gets_no_bundle():
    p = _plan("local:d2@cpu+fsdp:d2@cpu", servers=0)
    assert [s.name for s in p.slots] == ["actor-rank0", "actor-rank1"] and len(p.bundles) == 2


def test_colocated_ranks_share_their_servers_bundle_and_devices():
    p = _plan("vllm:d2|fsdp:d2")
    assert p.bundles == [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 3.0, "GPU": 1.0}]
    ranks = [s for s in p.slots if s.role == "actor"]
    assert [(s.bundle, s.gpus, s.shares_devices_with) for s in ranks] == [(0, 0, "rollout-0"), (1, 0, "rollout-1")]
    assert "rollout-0: {CPU: 3, GPU: 1}" in p.describe()


def test_local_ranks_follow_the_nodes_ranks_landed_on():
    assert local_ranks(["a", "b", "a", "b", "a"]) == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
