"""The fleet-wide weight-update group of the core (areal_core.rollout.weight_group), engine-neutral: its layout,
rebuilds at each topology version, tear-down, against member doubles whose ranks join a real gloo group in
threads of this process (the SGLang plugin's tests do the same over HTTP with server processes)."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from areal_core.rollout.elastic import Member
from areal_core.rollout.weight_group import FleetWeightGroup, GroupMemberFailed, plan_layout
from areal_core.testing.waits import scaled

TIMEOUT_S = scaled(20)  # the ranks' joins and broadcasts


def test_layout_gives_each_server_contiguous_ranks_after_the_trainer():
    layout = plan_layout(3, [("a:1", 2), ("b:1", 1), ("c:1", 4)], "127.0.0.1", 9000, "gloo")
    assert layout.world_size == 8 and layout.name.startswith("areal-weights-v3-")
    assert [layout.rank_offset(n) for n in ("a:1", "b:1", "c:1")] == [1, 3, 4]
    assert plan_layout(3, [("a:1", 2)], "127.0.0.1", 9000, "gloo").name != layout.name  # a retry gets a new name
    with pytest.raises(ValueError, match=r"inference server b:1 would join the weight-update group with 0 ranks"):
        plan_layout(0, [("a:1", 1), ("b:1", 0)], "127.0.0.1", 9000, "gloo")


class GroupMemberDouble:
    """Test double of a server taking part in a weight-update group: its ``weight_group_ranks`` ranks join the
    group in threads, receive every broadcast tensor, and it records what it was asked."""

    def __init__(self, ranks: int = 1) -> None:
        self.weight_group_ranks = ranks
        self.groups: dict[str, tuple[int, list]] = {}  # name -> (world size, [process group per rank])
        self.received: dict[str, object] = {}
        self.calls: list[str] = []
        self.version = 0

    async def join_weight_group(self, layout, rank_offset):
        import torch.distributed as dist

        self.calls.append(f"join {layout.name}")
        timeout = datetime.timedelta(seconds=TIMEOUT_S)

        def join(rank):
            store = dist.TCPStore(layout.host, layout.port, layout.world_size, is_master=False, timeout=timeout)
            return dist.ProcessGroupGloo(dist.PrefixStore(layout.name, store), rank, layout.world_size, timeout)

        ranks = range(rank_offset, rank_offset + self.weight_group_ranks)
        self.groups[layout.name] = (layout.world_size, await asyncio.gather(*(asyncio.to_thread(join, r)
                                                                             for r in ranks)))

    async def receive_weight_bucket(self, layout, names, dtypes, shapes):
        import torch
        import torch.distributed as dist

        self.calls.append(f"receive {layout.name}")
        world, ranks = self.groups[layout.name]  # KeyError: asked to receive on a group it does not hold

        def receive(group):
            out = {}
            for name, dtype, shape in zip(names, dtypes, shapes):
                out[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                options = dist.BroadcastOptions()
                options.rootRank = 0
                group.broadcast([out[name]], options).wait()
            return out

        copies = await asyncio.gather(*(asyncio.to_thread(receive, g) for g in ranks))
        self.received.update(copies[0])

    async def leave_weight_group(self, layout):
        self.calls.append(f"leave {layout.name}")
        del self.groups[layout.name]

    def set_version(self, version):
        self.version = version


def tensors(seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.w", torch.randn(8, 8, generator=g)) for i in range(3)]


def test_the_group_is_rebuilt_when_the_topology_changes_and_a_leaver_is_never_asked():
    import torch

    async def body():
        a, b, c = GroupMemberDouble(2), GroupMemberDouble(1), GroupMemberDouble(1)
        ma, mb, mc = Member(a, "a:1"), Member(b, "b:1"), Member(c, "c:1")
        group = FleetWeightGroup(host="127.0.0.1", backend="gloo", bucket_bytes=300, timeout_s=TIMEOUT_S)
        await group.update([ma, mb], 0, tensors(1), 1)
        first = group.layout
        await group.update([ma, mb], 0, tensors(2), 2)  # same topology: same group
        assert group.layout == first and group.builds == 1 and first.world_size == 4
        b_calls = len(b.calls)
        await group.update([ma, mc], 1, tensors(3), 3)  # b left, c joined: topology version 1
        second = group.layout
        await group.drop([ma, mc])
        return a, b, c, first, second, b_calls, group

    a, b, c, first, second, b_calls, group = asyncio.run(body())
    assert second.topology_version == 1 and second.world_size == 4 and second.name != first.name
    assert [second.rank_offset(n) for n in ("a:1", "c:1")] == [1, 3]
    assert len(b.calls) == b_calls, f"the server that left was asked {b.calls[b_calls:]}"
    assert a.calls.count(f"leave {first.name}") == 1 and a.groups == {} and c.groups == {}
    for member in (a, c):
        assert member.version == 3
        assert all(torch.equal(member.received[n], t) for n, t in tensors(3))
    assert b.version == 2 and group.layout is None


def test_a_member_that_refuses_is_named_and_the_group_is_dropped():
    class RefusingMemberDouble(GroupMemberDouble):
        async def receive_weight_bucket(self, layout, names, dtypes, shapes):
            raise RuntimeError("no weights update group named " + layout.name)

    async def body():
        a, bad = GroupMemberDouble(1), RefusingMemberDouble(1)
        ma, mbad = Member(a, "a:1"), Member(bad, "bad:1")
        # the trainer's broadcast to the refusing rank ends by this timeout (in its thread, after the failure)
        group = FleetWeightGroup(host="127.0.0.1", backend="gloo", bucket_bytes=300, timeout_s=scaled(3))
        with pytest.raises(GroupMemberFailed) as failed:
            await group.update([ma, mbad], 0, tensors(1), 1)
        return failed.value, group, a

    failed, group, a = asyncio.run(body())
    assert failed.member.name == "bad:1" and "no weights update group named" in str(failed.cause)
    assert group.layout is None and a.groups == {} and a.version == 0  # dropped on the one still there


def test_a_survivor_failing_because_another_server_died_does_not_take_the_blame():
    """A server killed mid-broadcast makes the broadcast fail on a survivor first (gloo: connection reset), and
    its own call fails a moment later: the dead one is named (and leaves routing), not the survivor."""
    from areal_core.rollout.interruptible import ENGINE_FAILURES

    class EchoFailureMemberDouble(GroupMemberDouble):
        async def receive_weight_bucket(self, layout, names, dtypes, shapes):
            raise RuntimeError("Read error [127.0.0.1]:45267: Connection reset by peer")

    class DyingMemberDouble(GroupMemberDouble):
        async def receive_weight_bucket(self, layout, names, dtypes, shapes):
            await asyncio.sleep(0.3)
            raise ConnectionRefusedError("the server at dead:1 refused the connection")

    async def body():
        survivor, dead = EchoFailureMemberDouble(1), DyingMemberDouble(1)
        group = FleetWeightGroup(host="127.0.0.1", backend="gloo", bucket_bytes=300, timeout_s=scaled(3))
        with pytest.raises(GroupMemberFailed) as failed:
            await group.update([Member(survivor, "survivor:1"), Member(dead, "dead:1")], 0, tensors(1), 1)
        return failed.value

    failed = asyncio.run(body())
    assert failed.member.name == "dead:1" and isinstance(failed.cause, ENGINE_FAILURES)
