"""ONE weight-update group over every routed SGLang server, rebuilt at each topology version, under the rollout
controller, against TEST DOUBLES of SGLang's HTTP protocol (sglang_server_double.py: real HTTP server processes
whose tensor-parallel ranks join a real torch.distributed gloo group with the trainer's rank 0)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from areal_core.api import GenerationRequest, SamplingParams, ServerProcess, Workflow
from areal_core.remote import ServerFleet, http_ready
from areal_core.rollout import RolloutController
from areal_core.rollout.elastic import ElasticConfig
from areal_core.rollout.weight_group import GroupLayout
from areal_core.testing import scaled, wait_until
from areal_sglang.engine import SGLangEngine

DOUBLE = Path(__file__).with_name("sglang_server_double.py")

TP = 2  # ranks each double joins with: one group of two servers is 1 + 2 * TP ranks
# every wait on the doubles (joining, broadcasts, requests) ends well before the suite's patience; a test that
# a wait was not taken checks that an update took well under it
TIMEOUT_S = scaled(20)
LAYER_MB = 2 * 64 * 64 * 2 / 2**20  # buckets of about one decoder layer of weights()


def double_recipe(index: int, port: int) -> ServerProcess:
    return ServerProcess([sys.executable, str(DOUBLE), "--port", str(port), "--tp", str(TP),
                          "--group-timeout-s", str(TIMEOUT_S)], http_ready(port),
                         f"the SGLang protocol double {index} on 127.0.0.1:{port}", startup_timeout_s=scaled(60))


def save(tmp_path: Path, weights, seed: int) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path / f"w{seed}"
    folder.mkdir()
    save_file(weights(seed), str(folder / "model.safetensors"))
    return folder


class EchoWorkflowDouble(Workflow):
    """Test double of a workflow: one 6-token completion per item, returned as the engine's response."""

    async def arun_episode(self, engine, item):
        return [await engine.agenerate(GenerationRequest([5, 17, item], SamplingParams(max_new_tokens=6),
                                                         rid=f"item-{item}"))]


def engine_for(address: str) -> SGLangEngine:
    return SGLangEngine(None, address, weight_bucket_mb=LAYER_MB, weight_group_backend="gloo",
                        request_timeout_s=TIMEOUT_S)


def info(address: str) -> dict:
    import httpx

    return httpx.get(f"http://{address}/get_server_info", timeout=10).json()


def check_agreement(ctrl: RolloutController, addresses: list[str], topology_version: int) -> GroupLayout:
    """The trainer's group and every routed server's agree: one group, of this topology version, of the size
    1 + sum(t), each server holding exactly the ranks the layout gives it; the servers that left hold none."""
    layout = ctrl.weight_group.layout
    assert layout is not None and layout.topology_version == topology_version == ctrl.topology.version
    assert layout.name.startswith(f"areal-weights-v{topology_version}-")
    assert layout.world_size == 1 + TP * len(addresses)
    assert [name for name, _, _ in layout.ranks] == addresses == list(ctrl.topology.members)
    for address in addresses:
        groups = info(address)["groups"]
        offset = layout.rank_offset(address)
        assert groups == {layout.name: {"world_size": layout.world_size, "ranks": list(range(offset, offset + TP))}}, \
            f"{address} holds {groups}, the trainer {layout}"
    return layout


@pytest.fixture
def fleet(tmp_path):
    with ServerFleet(tmp_path / "logs") as f:
        yield f


def test_one_group_over_two_servers_gives_each_the_weights_from_disk(fleet, tmp_path, make_weights,
                                                                     weights_digest):
    weights, digest = make_weights, weights_digest
    a, b = fleet.launch(double_recipe, 2, prefix="sglang-double")
    w1 = save(tmp_path, weights, 1)
    elastic = ElasticConfig(enabled=True, interval_s=0.5, failure_threshold=3, cooldown_s=0.0)
    with RolloutController([engine_for(a.address), engine_for(b.address)], EchoWorkflowDouble(), batch_size=2,
                           elastic=elastic, request_timeout_s=TIMEOUT_S, call_timeout_s=60) as ctrl:
        ctrl.update_weights_from_disk(str(w1), 1)
        from_disk = {s.address: info(s.address)["weights"] for s in (a, b)}
        buckets = {s.address: info(s.address)["buckets"] for s in (a, b)}
        ctrl.update_weights_from_tensors(list(weights(2).items()), 2)
        layout = check_agreement(ctrl, [a.address, b.address], 0)
        ctrl.update_weights_from_tensors(list(weights(1).items()), 3)  # the same group again: no rebuild
        assert ctrl.weight_group.layout == layout and ctrl.weight_group.builds == 1
        results = ctrl.evaluate(EchoWorkflowDouble(), list(range(8))).result(scaled(60))
        for s in (a, b):
            held = info(s.address)
            assert held["weights"] == from_disk[s.address] == digest(weights(1)), \
                f"{s.address}: tensors over the shared group differ from the same tensors on disk"
            assert held["buckets"] - buckets[s.address] == 8  # 4 buckets an update, 2 updates, each received once
        assert all(set(r[0].output_versions) == {3} for r in results)
    assert info(a.address)["groups"] == {} and info(b.address)["groups"] == {}, "close() left the group behind"


def test_leave_and_join_rebuild_the_group_at_the_next_topology_version(fleet, tmp_path, make_weights,
                                                                      weights_digest):
    weights, digest = make_weights, weights_digest
    a, b = fleet.launch(double_recipe, 2, prefix="sglang-double")
    folders = {seed: save(tmp_path, weights, seed) for seed in (1, 4)}
    # probes slow enough that a busy but live double (joining, receiving) always answers one in time
    elastic = ElasticConfig(enabled=True, interval_s=0.5, failure_threshold=3, cooldown_s=0.0)
    with RolloutController([engine_for(a.address), engine_for(b.address)], EchoWorkflowDouble(), batch_size=2,
                           elastic=elastic, engine_factory=engine_for, request_timeout_s=TIMEOUT_S,
                           call_timeout_s=120) as ctrl:
        ctrl.update_weights_from_disk(str(folders[1]), 1)
        ctrl.update_weights_from_tensors(list(weights(2).items()), 2)
        first = check_agreement(ctrl, [a.address, b.address], 0)

        fleet.kill(b)  # mid-run: its probes fail and it leaves routing
        wait_until(lambda: ctrl.topology.members == (a.address,), 20, f"{b.address} to leave routing")
        began = time.monotonic()
        ctrl.update_weights_from_tensors(list(weights(3).items()), 3)
        took = time.monotonic() - began
        smaller = check_agreement(ctrl, [a.address], 1)
        assert smaller.name != first.name and ctrl.weight_group.builds == 2
        assert took < TIMEOUT_S / 2, f"the update waited {took:.1f} s: it waited for the server that left"
        assert info(a.address)["weights"] == digest(weights(3))

        ctrl.update_weights_from_disk(str(folders[4]), 4)  # a joiner is brought up from disk
        c = fleet.launch(double_recipe, 1, prefix="sglang-joiner")[0]
        joined = ctrl.add_server(c.address)
        assert joined.version == 2 and joined.members == (a.address, c.address)
        assert info(c.address)["weights"] == digest(weights(4)), "the joiner took traffic before the weights"
        ctrl.update_weights_from_tensors(list(weights(5).items()), 5)
        check_agreement(ctrl, [a.address, c.address], 2)
        assert ctrl.weight_group.builds == 3
        assert info(a.address)["weights"] == info(c.address)["weights"] == digest(weights(5))

        served_before = info(c.address)["requests"]
        results = ctrl.evaluate(EchoWorkflowDouble(), list(range(12))).result(scaled(60))
        assert all(set(r[0].output_versions) == {5} for r in results)
        assert info(c.address)["requests"] > served_before, "the joiner took no traffic"


def test_a_server_refuses_a_group_it_does_not_hold_or_holds_already(fleet, make_weights):
    weights = make_weights
    (a,) = fleet.launch(double_recipe, 1, prefix="sglang-double")

    async def body():
        engine = engine_for(a.address)
        await engine.start()
        try:
            await engine.update_weights_from_tensors(weights(1).items(), 1)  # its own group, held now
            held = next(iter((await engine.request("GET", "/get_server_info"))["groups"]))
            stale = GroupLayout(held.replace("-v0-", "-v7-"), 7, ((a.address, 1, TP),), "127.0.0.1", 1, "gloo")
            with pytest.raises(RuntimeError, match=r"could not load a weight bucket .* no weights update group"):
                await engine.receive_weight_bucket(stale, ["model.norm.weight"], ["bfloat16"], [[64]])
            again = GroupLayout(held, 0, ((a.address, 1, TP),), "127.0.0.1", 1, "gloo")
            with pytest.raises(RuntimeError, match=r"could not join weight-update group .* already exists"):
                await engine.join_weight_group(again, 1)
        finally:
            await engine.aclose()

    began = time.monotonic()
    asyncio.run(body())
    assert time.monotonic() - began < TIMEOUT_S


class DyingSGLangEngineDouble(SGLangEngine):
    """Test double: the SGLang client, which kills its own server (when ``kill`` is set) just before the
    server would receive the next weight bucket: a server that dies in the middle of a tensor update."""

    kill = None

    async def receive_weight_bucket(self, layout, names, dtypes, shapes):
        if self.kill is not None:
            kill, self.kill = self.kill, None
            await asyncio.to_thread(kill)
        await super().receive_weight_bucket(layout, names, dtypes, shapes)


def test_a_server_dying_inside_an_update_leaves_and_the_update_completes_over_a_smaller_group(
        fleet, make_weights, weights_digest):
    weights, digest = make_weights, weights_digest
    a, b = fleet.launch(double_recipe, 2, prefix="sglang-double")
    engines = [DyingSGLangEngineDouble(None, s.address, weight_bucket_mb=LAYER_MB, weight_group_backend="gloo",
                                       request_timeout_s=TIMEOUT_S) for s in (a, b)]
    elastic = ElasticConfig(enabled=True, interval_s=0.5, failure_threshold=3, cooldown_s=0.0)
    with RolloutController(engines, EchoWorkflowDouble(), batch_size=2, elastic=elastic,
                           request_timeout_s=TIMEOUT_S, call_timeout_s=120) as ctrl:
        ctrl.update_weights_from_tensors(list(weights(2).items()), 2)
        check_agreement(ctrl, [a.address, b.address], 0)
        engines[1].kill = lambda: fleet.kill(b)
        began = time.monotonic()
        ctrl.update_weights_from_tensors(list(weights(3).items()), 3)
        took = time.monotonic() - began
        check_agreement(ctrl, [a.address], 1)
        assert took < TIMEOUT_S, f"the update waited {took:.1f} s: it waited for the server that died"
        assert info(a.address)["weights"] == digest(weights(3)) and engines[0].version == 3
        results = ctrl.evaluate(EchoWorkflowDouble(), list(range(4))).result(scaled(60))
        assert all(set(r[0].output_versions) == {3} for r in results)
