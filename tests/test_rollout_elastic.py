"""Elastic topology of the rollout controller against engine doubles: servers
that fail leave routing with nothing lost or duplicated, servers that join are
brought to the current weights first, rebuilds respect the cooldown, the
topology version tracks the routed set. (Real vLLM servers: the vllm plugin's
slow tests.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_core.rollout import RolloutController, RolloutError
from areal_core.rollout.elastic import DOWN, ElasticConfig, NoEngineError
from areal_core.testing.latency_engine import GroupWorkflowDouble, LatencyEngineDouble, items, token_for
from areal_core.testing.waits import scaled, wait_until

FAST = dict(enabled=True, interval_s=0.02, failure_threshold=2, cooldown_s=0.0)


class DyingEngineDouble(LatencyEngineDouble):
    """Test double: a server that can be killed mid-request (calls then raise ConnectionError,
    health() answers False) and that records what it served."""

    def __init__(self, address: str, seed: int = 0, max_token_latency_s: float = 0.002) -> None:
        super().__init__(seed=seed, max_token_latency_s=max_token_latency_s)
        self.address = address
        self.dead = False
        self.starts = 0
        self.served_versions: list[int] = []

    def _check(self) -> None:
        if self.dead:
            raise ConnectionError(f"the double at {self.address} is down")

    async def start(self):
        self.starts += 1

    async def health(self):
        return not self.dead

    async def agenerate(self, request):
        self._check()
        inner = asyncio.ensure_future(super().agenerate(request))
        while not inner.done():
            if self.dead:
                inner.cancel()
                await asyncio.gather(inner, return_exceptions=True)
                self._check()
            await asyncio.sleep(0.001)
        response = inner.result()
        self.served_versions += response.output_versions
        return response

    async def pause(self):
        self._check()
        await super().pause()

    async def resume(self):
        self._check()
        await super().resume()

    async def update_weights_from_disk(self, path, version):
        self._check()
        await super().update_weights_from_disk(path, version)


def controller(engines, *, elastic=None, batch_size=4, eta=1, **kw):
    return RolloutController(engines, GroupWorkflowDouble(2), batch_size=batch_size, max_head_offpolicyness=eta,
                             max_concurrent_rollouts=16, elastic=elastic, request_timeout_s=scaled(30), **kw)


def step(ctrl, data):
    batch = ctrl.prepare_batch(data, timeout=scaled(30))
    version = ctrl.version + 1
    ctrl.update_weights_from_disk(f"/ckpt/v{version}", version)
    return batch


def check_complete(batch):
    """Every trajectory holds exactly the tokens an uninterrupted request gives (the doubles' token at a
    position depends on the request id and the position only): nothing lost, nothing sampled twice."""
    for group in batch:
        for traj in group.trajectories:
            rid, prompt = traj.info["rid"], 4
            expected = [token_for(rid, prompt + k) for k in range(group.item["length"])]
            assert traj.tokens[prompt:] == expected, f"request {rid} came back with other tokens"
            versions = traj.versions[prompt:]
            assert versions == sorted(versions)


@pytest.fixture(params=["inline", "own-task"])
def call_path(request, monkeypatch):
    """Both ways an engine call can run: in the caller's task (Python 3.11+, ``watched``) and in a task of its own
    (``settle``, what Python 3.10 gets), so the older path stays tested where CI runs 3.11."""
    import areal_core.rollout.interruptible as interruptible
    from areal_core.rollout.elastic import INLINE_CALLS

    if request.param == "inline" and not INLINE_CALLS:
        pytest.skip("Python < 3.11 has no Task.uncancel")
    monkeypatch.setattr(interruptible, "INLINE_CALLS", request.param == "inline")
    return request.param


@pytest.mark.usefixtures("call_path")
def test_killed_server_leaves_routing_and_its_requests_finish_elsewhere():
    data = items(200, seed=5, max_length=30)
    a, b = DyingEngineDouble("10.0.0.1:1"), DyingEngineDouble("10.0.0.2:1")
    with controller([a, b], elastic=ElasticConfig(**FAST)) as ctrl:
        first = step(ctrl, data)
        assert ctrl.topology.size == 2 and ctrl.topology.version == 0
        on_b = next(m for m in ctrl.members() if m.name == "10.0.0.2:1")
        wait_until(lambda: on_b.in_flight > 0, 10, "a request in flight on the server about to be killed", 0.001)
        b.dead = True  # mid-run: requests are in flight on it
        rest = [step(ctrl, data) for _ in range(4)]
        members = {m.name: m for m in ctrl.members()}
        topology = ctrl.topology
        stats = ctrl.stats()
    batches = [first, *rest]
    ids = [g.item["id"] for batch in batches for g in batch]
    assert len(ids) == len(set(ids)) == 20  # no group lost or trained twice
    assert sorted(ids) == list(range(20))  # eta=1 keeps the order within reach; nothing skipped
    for batch in batches:
        check_complete(batch)
    assert members["10.0.0.2:1"].state == DOWN and members["10.0.0.1:1"].state == "active"
    assert (topology.version, topology.members) == (1, ("10.0.0.1:1",))
    assert stats["servers"] == 1
    assert b.served_versions and a.served_versions
    assert members["10.0.0.2:1"].moved > 0, "no request was in flight on the killed server"


class HangingEngineDouble(DyingEngineDouble):
    """Test double: a server that hangs (requests never answer, never fail) and fails its health probes,
    so only the health monitor can notice it."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.hung_at: float | None = None

    async def health(self):
        return self.hung_at is None

    async def _hang_if_hung(self):
        if self.hung_at is not None:
            await asyncio.Event().wait()  # never answers, as a hung server's HTTP endpoint does not

    async def pause(self):
        await self._hang_if_hung()
        await super().pause()

    async def resume(self):
        await self._hang_if_hung()
        await super().resume()

    async def update_weights_from_disk(self, path, version):
        await self._hang_if_hung()
        await super().update_weights_from_disk(path, version)

    async def agenerate(self, request):
        inner = asyncio.ensure_future(DyingEngineDouble.agenerate(self, request))
        while not inner.done():
            if self.hung_at is not None:
                inner.cancel()
                await asyncio.gather(inner, return_exceptions=True)
                await asyncio.Event().wait()  # never answers: cancelled when its server leaves routing
            await asyncio.sleep(0.001)
        return inner.result()


@pytest.mark.usefixtures("call_path")
def test_hung_server_leaves_routing_after_n_failed_probes_and_its_requests_finish_elsewhere():
    data = items(200, seed=6, max_length=30)
    a, b = DyingEngineDouble("a:1"), HangingEngineDouble("b:1")
    elastic = ElasticConfig(enabled=True, interval_s=0.1, failure_threshold=3, cooldown_s=0.0)
    with controller([a, b], elastic=elastic, eta=1) as ctrl:
        first = step(ctrl, data)
        on_b = next(m for m in ctrl.members() if m.name == "b:1")
        wait_until(lambda: on_b.in_flight > 0, 10, "a request in flight on the server about to hang", 0.001)
        b.hung_at = time.monotonic()
        rest = [step(ctrl, data) for _ in range(3)]
        left_at = next(t for t, what, name in ctrl.pool.events if what == "left" and name == "b:1")
        probes = ctrl.monitor.probes
    batches = [first, *rest]
    ids = [g.item["id"] for batch in batches for g in batch]
    assert sorted(ids) == list(range(16)), "a group was lost or trained twice"
    for batch in batches:
        check_complete(batch)
    assert on_b.state == DOWN and on_b.moved > 0
    assert on_b.failures == 3  # the threshold, from probes alone: its requests never failed
    # three failed probes interval_s apart: at least two intervals after it hung (the first may come at once)
    assert left_at - b.hung_at >= 2 * elastic.interval_s - 0.02
    assert probes >= 3


def test_server_hanging_in_a_weight_update_leaves_routing_and_the_update_completes():
    data = items(200, seed=7, max_length=30)
    a, b = DyingEngineDouble("a:1"), HangingEngineDouble("b:1")
    elastic = ElasticConfig(enabled=True, interval_s=0.05, failure_threshold=3, cooldown_s=0.0)
    with controller([a, b], elastic=elastic, eta=1, call_timeout_s=scaled(20)) as ctrl:
        first = step(ctrl, data)
        b.hung_at = time.monotonic()  # its /pause will never answer
        ctrl.update_weights_from_disk("/ckpt/v2", 2)  # returns once the monitor has removed it
        rest = [step(ctrl, data) for _ in range(3)]
        members = {m.name: m for m in ctrl.members()}
    assert members["b:1"].state == DOWN
    assert a.updates[:2] == [("/ckpt/v1", 1), ("/ckpt/v2", 2)] and b.updates == [("/ckpt/v1", 1)]
    ids = [g.item["id"] for batch in [first, *rest] for g in batch]
    assert len(ids) == len(set(ids)) == 16, "a group was trained twice"
    for batch in [first, *rest]:  # every trajectory whole: nothing lost with the hung server
        check_complete(batch)


def test_joining_server_gets_current_weights_before_traffic():
    data = items(200, seed=3, max_length=12)
    a = DyingEngineDouble("a:1")
    c = DyingEngineDouble("c:1")
    with controller([a], elastic=ElasticConfig(**FAST)) as ctrl:
        for _ in range(2):
            step(ctrl, data)
        assert ctrl.version == 2 and c.version == 0
        topology = ctrl.add_engine(c)
        assert c.updates == [("/ckpt/v2", 2)]  # loaded from disk before it was routed to
        assert c.served_versions == []
        assert (topology.version, topology.members) == (1, ("a:1", "c:1"))
        for _ in range(3):
            step(ctrl, data)
    assert c.starts == 1
    assert c.served_versions, "the joined server never received a request"
    assert min(c.served_versions) >= 2  # never served the weights it started with


def test_join_waits_for_the_cooldown_between_rebuilds():
    data = items(100, seed=4, max_length=6)
    a, b, c = DyingEngineDouble("a:1"), DyingEngineDouble("b:1"), DyingEngineDouble("c:1")
    with controller([a], elastic=ElasticConfig(enabled=True, interval_s=0.02, failure_threshold=2, cooldown_s=0.6)) as ctrl:
        step(ctrl, data)
        began = time.monotonic()
        ctrl.add_engine(b)  # the first rebuild: 0.6 s after the controller started
        ctrl.add_engine(c)  # the second: 0.6 s after the first
        waited = time.monotonic() - began
        assert ctrl.topology.version == 2 and ctrl.topology.size == 3
    assert waited >= 0.6


def test_discovery_file_adds_servers():
    data = items(100, seed=4, max_length=6)

    def factory(address):
        return DyingEngineDouble(address)

    def run(path):
        elastic = ElasticConfig(**FAST, discovery=True, discovery_file=str(path))
        with controller([DyingEngineDouble("a:1")], elastic=elastic, engine_factory=factory) as ctrl:
            step(ctrl, data)
            path.write_text("a:1\nd:1\n")
            wait_until(lambda: ctrl.topology.size == 2, 10, "the server in the discovery file to join")
            step(ctrl, data)
            return ctrl.topology

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        topology = run(Path(folder) / "servers.txt")
    assert topology.members == ("a:1", "d:1")


def test_every_server_down_is_a_clear_error():
    data = items(100, seed=4, max_length=30)
    a = DyingEngineDouble("a:1")
    with controller([a], elastic=ElasticConfig(**FAST)) as ctrl:
        step(ctrl, data)
        a.dead = True
        with pytest.raises((RolloutError, NoEngineError, ConnectionError)) as info:
            step(ctrl, data)
    assert "a:1" in str(info.value)


def test_without_elastic_a_failing_server_is_an_error():
    data = items(100, seed=4, max_length=30)
    a = DyingEngineDouble("a:1")
    with controller([a]) as ctrl:
        step(ctrl, data)
        a.dead = True
        with pytest.raises((RolloutError, ConnectionError)) as info:
            step(ctrl, data)
    assert "a:1" in str(info.value)


@pytest.mark.usefixtures("call_path")
def test_without_elastic_a_hung_server_is_an_error_naming_the_request_timeout():
    """A request a hung server never answers ends at rollout.request_timeout_s with that key named, on either
    call path, and nothing of the timeout outlives it."""
    data = items(40, seed=7, max_length=30)
    a = HangingEngineDouble("h:1")
    ctrl = RolloutController([a], GroupWorkflowDouble(2), batch_size=2, max_head_offpolicyness=1,
                             max_concurrent_rollouts=4, request_timeout_s=0.3)
    with ctrl:
        step(ctrl, data)
        a.hung_at = time.monotonic()
        began = time.monotonic()
        with pytest.raises((RolloutError, TimeoutError)) as info:
            step(ctrl, data)
    assert "rollout.request_timeout_s" in str(info.value) and "h:1" in str(info.value)
    assert time.monotonic() - began < scaled(20)  # the request timeout (0.3 s), not the controller's call timeout


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"interval_s": 0}, "interval_s"),
    ({"failure_threshold": 0}, "failure_threshold"),
    ({"cooldown_s": -1}, "cooldown_s"),
])
def test_elastic_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ElasticConfig(**kwargs)


def test_discovery_without_a_file_is_refused_at_start():
    ctrl = controller([DyingEngineDouble("a:1")], elastic=ElasticConfig(enabled=True, discovery=True),
                      engine_factory=lambda address: DyingEngineDouble(address))
    with pytest.raises(ValueError, match="rollout.elastic.discovery_file"):
        ctrl.start()
    ctrl.close()


def test_elastic_off_keeps_the_plain_controller():
    ctrl = controller([DyingEngineDouble("a:1")], elastic=ElasticConfig(enabled=False))
    assert ctrl.elastic is None


def test_join_before_any_weights_on_disk_at_a_later_version_is_refused():
    data = items(100, seed=4, max_length=6)
    a, late = DyingEngineDouble("a:1"), DyingEngineDouble("late:1")
    with controller([a], elastic=ElasticConfig(**FAST)) as ctrl:
        ctrl.prepare_batch(data, timeout=scaled(30))
        ctrl.set_version(3)  # as after a tensor-based update: nothing on disk to load
        with pytest.raises(RuntimeError, match="could not join"):
            ctrl.add_engine(late)
        assert ctrl.topology.members == ("a:1",)


class PoisonEngineDouble(DyingEngineDouble):
    """Test double: a healthy server that fails (HTTP-500 style) on the item with id 7 only."""

    async def agenerate(self, request):
        if request.rid.startswith("7-"):
            from areal_core.remote import RemoteError

            raise RemoteError(f"{self.address} crashed on request {request.rid}")
        return await super().agenerate(request)


def test_a_request_failing_everywhere_is_an_error_not_an_outage():
    data = items(40, seed=4, max_length=4)
    engines = [PoisonEngineDouble(f"p{i}:1") for i in range(3)]
    elastic = ElasticConfig(enabled=True, interval_s=0.02, failure_threshold=5, cooldown_s=0.0)
    with controller(engines, elastic=elastic, eta=0) as ctrl:
        with pytest.raises(RolloutError, match="request 7-.* failed on 4 inference servers in turn"):
            for _ in range(4):
                step(ctrl, data)
        survivors = ctrl.topology.size
    assert survivors >= 2  # a probe succeeds between failures: the servers stay


class TensorEngineDouble(DyingEngineDouble):
    """Test double: also takes weights as tensors (one engine at a time: no shared weight-update group)."""

    capabilities = frozenset({"pause", "update_weights_from_disk", "update_weights_from_tensors"})

    async def update_weights_from_tensors(self, named_tensors, version):
        self._check()
        self.updates.append((list(named_tensors), version))
        self._version = version


class DiskOnlyEngineDouble(DyingEngineDouble):
    """Test double: takes weights from disk only."""

    capabilities = frozenset({"pause", "update_weights_from_disk"})


def test_a_join_after_a_tensor_update_gets_the_latest_tensors_never_the_older_weights_on_disk():
    """The latest disk folder is one version behind after an update by tensors: a joiner loading it would
    serve those older weights stamped with the current version. It gets the tensors of the current version
    (kept by an elastic controller); a joiner that cannot take tensors is refused, naming why."""
    data = items(100, seed=4, max_length=6)
    a, late, disk_only = TensorEngineDouble("a:1"), TensorEngineDouble("late:1"), DiskOnlyEngineDouble("disk:1")
    with controller([a], elastic=ElasticConfig(**FAST)) as ctrl:
        step(ctrl, data)  # version 1 from disk
        ctrl.prepare_batch(data, timeout=scaled(30))
        ctrl.update_weights_from_tensors([("w", 0.5)], 2)
        assert a.version == 2
        ctrl.add_engine(late)
        assert late.updates == [([("w", 0.5)], 2)] and late.starts == 1
        with pytest.raises(RuntimeError, match="could not join"):
            ctrl.add_engine(disk_only)
        assert disk_only.version == 0 and disk_only.updates == []
        assert ctrl.topology.members == ("a:1", "late:1")


def test_a_plain_controller_keeps_no_copy_of_the_tensors():
    """Only an elastic controller (servers may join) holds the latest tensors: one model's copy."""
    data = items(100, seed=4, max_length=6)
    with controller([TensorEngineDouble("a:1")]) as ctrl:
        step(ctrl, data)
        ctrl.prepare_batch(data, timeout=scaled(30))
        ctrl.update_weights_from_tensors([("w", 0.5)], 2)
        assert ctrl.fleet.weights_tensors is None


def test_servers_leaving_and_joining_are_reported_and_the_launchers_file_is_read(tmp_path):
    """The trainer shows topology changes on the terminal through on_topology_event; the launcher lists the
    servers it restarted in its own file, read whether or not rollout.elastic.discovery is on; a joiner
    found there is started, brought to the current weights, then routed."""
    data = items(100, seed=4, max_length=6)
    seen = []
    launcher_file = tmp_path / "restarted-servers.txt"
    a, b = DyingEngineDouble("a:1"), DyingEngineDouble("b:1")
    with controller([a, b], elastic=ElasticConfig(**FAST), engine_factory=DyingEngineDouble,
                    on_topology_event=lambda *event: seen.append(event),
                    launcher_discovery_file=str(launcher_file)) as ctrl:
        step(ctrl, data)
        b.dead = True
        wait_until(lambda: ctrl.topology.size == 1, 10, "the dead server to leave routing")
        launcher_file.write_text("c:1\n")
        wait_until(lambda: ctrl.topology.size == 2, 10, "the server in the launcher's file to join")
        step(ctrl, data)
        members = ctrl.topology.members
        joined = next(m.engine for m in ctrl.members() if m.name == "c:1")
    assert members == ("a:1", "c:1")
    assert [(kind, name) for kind, name, _ in seen] == [("left", "b:1"), ("joined", "c:1")]
    assert "1 server(s) left in routing" in seen[0][2] and "at version 1" in seen[1][2]
    assert joined.starts == 1 and joined.updates == [("/ckpt/v1", 1), ("/ckpt/v2", 2)]  # brought up, then updated


def test_the_routing_heap_always_picks_what_a_scan_of_every_member_would():
    """EnginePool.pick keeps a heap (O(log n) a pick); whatever sequence of requests starting and ending, servers
    leaving, joining and falling under suspicion, its pick equals the plain rule: the routable member with the
    fewest requests in flight, the first of them on ties."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from areal_core.rollout.elastic import ACTIVE, ElasticConfig, EnginePool

    class Engine:
        version = 0

        def __init__(self, i):
            self.address = f"e{i}:1"

    ops = st.lists(st.tuples(st.sampled_from(["acquire", "release", "remove", "suspect", "clear", "join"]),
                             st.integers(0, 11)), max_size=200)

    @settings(max_examples=300, deadline=None)
    @given(ops)
    def check(sequence):
        async def body():
            pool = EnginePool([Engine(i) for i in range(6)], ElasticConfig(enabled=True))
            for op, i in sequence:
                member = pool.members[i % len(pool.members)]
                if op == "acquire" and member.state == ACTIVE:
                    pool.acquire(member)
                elif op == "release" and member.in_flight > 0:
                    pool.release(member)
                elif op == "remove":
                    pool.remove(member, "test")
                elif op == "suspect":
                    member.suspect = True
                    pool.routing_changed()
                elif op == "clear":
                    pool.report_success(member)
                elif op == "join" and len(pool.members) < 12:
                    pool.add(Engine(len(pool.members)))
                    await pool.rebuild(lambda engine: asyncio.sleep(0))
                routable = [m for m in pool.members if m.state == ACTIVE and not m.suspect]
                expected = min(routable, key=lambda m: m.in_flight) if routable else None
                assert pool.pick() is expected

        asyncio.run(body())

    check()
