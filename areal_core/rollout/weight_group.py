"""One weight-update process group over the whole fleet, rebuilt at every topology version.

Servers that receive weights by broadcast (SGLang's ``/init_weights_update_group``,
the process-group path of AReaL, OpenRLHF and verl) join ONE torch process
group with the trainer: the trainer is rank 0, and each routed server's ``t``
workers take the next ``t`` ranks (its ``rank_offset`` is 1 + the ranks of the
servers before it, in topology order). A bucket is then broadcast once for
every server instead of once per server.

A process group has a fixed size, and a size the two sides disagree on hangs
or fails inside torch. So the group belongs to one :class:`Topology` version:
its name carries the version (``areal-weights-v{version}-...``) and its size is
``1 + sum(t)`` of that topology's members. When a server leaves or joins (the
topology version grows), the next tensor update first destroys the old group
on the servers still routed, never contacting one that left, then builds the
group of the new version, then sends. Everything here is engine-neutral; an
engine that takes part implements the member side (the :class:`GroupMember`
methods: its HTTP calls) and offers a class-level ``fleet_weight_group(engines)``
hook that the rollout controller uses when every routed engine has it.

No torch import at module load: the trainer's rank is made in a thread when a
group is built.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from dataclasses import dataclass
from itertools import count
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

from areal_core.processes.supervisor import free_port
from areal_core.remote import layer_buckets, send_pipelined
from areal_core.rollout.elastic import EngineLost, Member
from areal_core.rollout.interruptible import ENGINE_FAILURES

log = logging.getLogger("areal.rollout")

# How long a failed broadcast waits for the server calls to fail too (a dead server's call does, within moments).
BLAME_GRACE_S = 5.0
_builds = count()  # group names are unique in this process, even when a build at one version is retried


class GroupMember(Protocol):
    """What an engine implements to receive weights over a shared group (each call answers once the
    server's side is done, and raises naming the server when it refused)."""

    weight_group_ranks: int  # the server's workers that join (its tensor-parallel size t)

    async def join_weight_group(self, layout: GroupLayout, rank_offset: int) -> None: ...

    async def receive_weight_bucket(self, layout: GroupLayout, names: list[str], dtypes: list[str],
                                    shapes: list[list[int]]) -> None: ...

    async def leave_weight_group(self, layout: GroupLayout) -> None: ...

    def set_version(self, version: int) -> None: ...


@dataclass(frozen=True)
class GroupLayout:
    """Who holds which ranks of the group of one topology version; rank 0 is the trainer."""

    name: str
    topology_version: int
    ranks: tuple[tuple[str, int, int], ...]  # (member name, rank_offset, how many ranks), in topology order
    host: str
    port: int
    backend: str

    @property
    def world_size(self) -> int:
        return 1 + sum(n for _, _, n in self.ranks)

    @property
    def members(self) -> tuple[tuple[str, int], ...]:
        return tuple((name, n) for name, _, n in self.ranks)

    def rank_offset(self, member: str) -> int:
        for name, offset, _ in self.ranks:
            if name == member:
                return offset
        raise KeyError(f"{member} is not in weight-update group {self.name!r}")


def plan_layout(topology_version: int, members: Sequence[tuple[str, int]], host: str, port: int,
                backend: str) -> GroupLayout:
    """The layout for ``members`` ((name, ranks) in topology order): contiguous rank offsets from 1."""
    ranks, offset = [], 1
    for name, n in members:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"inference server {name} would join the weight-update group with {n!r} ranks; "
                             "each server joins with its tensor-parallel size t >= 1")
        ranks.append((name, offset, n))
        offset += n
    name = f"areal-weights-v{topology_version}-{os.getpid()}-{next(_builds)}"
    return GroupLayout(name, topology_version, tuple(ranks), host, port, backend)


class GroupMemberFailed(Exception):
    """A member's call failed during a group update; ``cause`` is what it raised (EngineLost: it left routing)."""

    def __init__(self, member: Member, cause: BaseException) -> None:
        super().__init__(f"{member.name}: {type(cause).__name__}: {cause}")
        self.member, self.cause = member, cause


class TrainerRank:
    """Rank 0 of a group: a TCPStore listening on ``layout.host:port`` and a gloo / nccl process group.

    A stand-alone torch process group, never the trainer's default one, so it
    can be made and dropped while training runs. Every call blocks: run them in
    a thread.
    """

    def __init__(self, layout: GroupLayout, timeout_s: float) -> None:
        self.layout, self.timeout_s = layout, timeout_s
        self._group: Any = None
        self._store: Any = None

    def connect(self) -> None:
        """Wait (up to ``timeout_s``) for every server rank to join; raises naming the group when they do not."""
        import torch.distributed as dist

        layout, timeout = self.layout, datetime.timedelta(seconds=self.timeout_s)
        try:
            self._store = dist.TCPStore(layout.host, layout.port, layout.world_size, is_master=True,
                                        timeout=timeout, wait_for_workers=True)
            store = dist.PrefixStore(layout.name, self._store)
            if layout.backend == "nccl":
                self._group = dist.ProcessGroupNCCL(store, 0, layout.world_size)
            else:
                self._group = dist.ProcessGroupGloo(store, 0, layout.world_size, timeout)
        except Exception as exc:  # torch raises a bare RuntimeError / DistStoreError naming nothing of ours
            raise TimeoutError(f"waited {self.timeout_s:.0f} s for the {layout.world_size - 1} server rank(s) to "
                               f"join weight-update group {layout.name!r} on {layout.host}:{layout.port} "
                               f"({layout.backend}): {type(exc).__name__}: {exc}") from None

    def broadcast(self, tensors: list[Any]) -> None:
        """Send ``tensors`` to every rank, in order (each receives into a tensor of the same shape and dtype)."""
        import torch.distributed as dist

        works = []
        for tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            works.append(self._group.broadcast([tensor], options))
        for work in works:
            work.wait()

    def close(self) -> None:
        self._group = None
        self._store = None


class FleetWeightGroup:
    """The trainer's side of the shared group: (re)built for the topology it is given, then broadcasts.

    ``bucket_bytes`` bounds a bucket (whole layers, see
    :func:`areal_core.remote.layer_buckets`); the next bucket is made ready
    (contiguous, on the GPU for nccl) while the current one is broadcast.
    ``timeout_s`` bounds the wait for the servers' ranks to join and for a
    broadcast.
    """

    def __init__(self, *, host: str, backend: str, bucket_bytes: int, timeout_s: float) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight-update group backend is {backend!r}; use 'nccl' (GPU servers) or 'gloo'")
        self.host, self.backend, self.bucket_bytes, self.timeout_s = host, backend, bucket_bytes, timeout_s
        self.layout: GroupLayout | None = None
        self.builds = 0  # groups built so far (a rebuild is visible in logs and tests)
        self._rank: TrainerRank | None = None

    async def update(self, members: Sequence[Member], topology_version: int,
                     named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Bring the group to ``members`` at ``topology_version`` (rebuilding when either differs from the
        group held), broadcast ``named_tensors`` to them, then set their policy ``version``.

        A member's failure raises :class:`GroupMemberFailed` naming it; so does a member leaving routing
        during the update (``cause`` :class:`EngineLost`). After any failure the group is destroyed on the
        members still routed: a broadcast cut half-way leaves it unusable, and the next update builds a
        fresh one.
        """
        members = list(members)
        if not members:
            raise ValueError("update_weights_from_tensors over a weight-update group needs at least one server")
        try:
            layout = await self._ensure(members, topology_version)
            device = "cuda" if self.backend == "nccl" else "cpu"

            def ready(bucket: dict[str, Any]) -> dict[str, Any]:
                return {name: t.to(device).contiguous() for name, t in bucket.items()}

            async def prepare(bucket: dict[str, Any]) -> dict[str, Any]:
                return await asyncio.to_thread(ready, bucket)

            async def send(bucket: dict[str, Any]) -> None:
                names = list(bucket)
                dtypes = [str(t.dtype).removeprefix("torch.") for t in bucket.values()]
                shapes = [list(t.shape) for t in bucket.values()]
                rank = self._rank
                await self._together(
                    members, lambda m: m.engine.receive_weight_bucket(layout, names, dtypes, shapes),
                    lambda: rank.broadcast(list(bucket.values())),
                    f"broadcast a weight bucket ({len(names)} tensors, the first {names[0]!r}) over {layout.name!r}")

            await send_pipelined(layer_buckets(named_tensors, self.bucket_bytes), prepare, send)
        except BaseException as exc:
            failed = exc.member if isinstance(exc, GroupMemberFailed) else None  # never asked again
            await self.drop([m for m in members if not m.lost.is_set() and m is not failed])
            raise
        for member in members:
            member.engine.set_version(version)

    async def drop(self, alive: Sequence[Member]) -> None:
        """Destroy the group held: on each of ``alive`` that is in it (a server that left is never
        contacted), then the trainer's rank. Best effort: a server that cannot answer is logged."""
        layout, rank = self.layout, self._rank
        self.layout, self._rank = None, None
        if layout is None:
            return
        inside = {name for name, _, _ in layout.ranks}
        holders = [m for m in alive if m.name in inside]
        results = await asyncio.gather(*(m.engine.leave_weight_group(layout) for m in holders),
                                       return_exceptions=True)
        for member, result in zip(holders, results):
            if isinstance(result, BaseException):
                log.warning("inference server %s could not destroy weight-update group %r: %s: %s", member.name,
                            layout.name, type(result).__name__, result)
        if rank is not None:
            rank.close()

    async def _ensure(self, members: list[Member], topology_version: int) -> GroupLayout:
        wanted = tuple((m.name, int(getattr(m.engine, "weight_group_ranks", 1))) for m in members)
        held = self.layout
        if held is not None and held.topology_version == topology_version and held.members == wanted:
            return held
        if held is not None:
            log.info("weight-update group %r (topology version %d, %d ranks) is destroyed: the servers are now "
                     "topology version %d", held.name, held.topology_version, held.world_size, topology_version)
            await self.drop(members)
        layout = plan_layout(topology_version, wanted, self.host, free_port(self.host), self.backend)
        rank = TrainerRank(layout, self.timeout_s)
        self.layout, self._rank = layout, rank
        self.builds += 1
        await self._together(members, lambda m: m.engine.join_weight_group(layout, layout.rank_offset(m.name)),
                             rank.connect, f"join weight-update group {layout.name!r}")
        log.info("weight-update group %r built: topology version %d, world size %d (%s)", layout.name,
                 topology_version, layout.world_size,
                 ", ".join(f"{name} at ranks {o}..{o + n - 1}" for name, o, n in layout.ranks))
        return layout

    async def _together(self, members: list[Member], call: Callable[[Member], Awaitable[Any]],
                        work: Callable[[], Any], what: str) -> None:
        """Run ``call(member)`` for every member and the trainer's blocking ``work`` (in a thread) together.

        A member that fails or leaves routing raises :class:`GroupMemberFailed` at once, and the others'
        calls are cancelled: the trainer's side would otherwise wait for a rank that is not coming. The
        trainer's work cannot be interrupted; it ends by its own timeout and its failure is then ignored.
        """
        calls = {asyncio.ensure_future(call(m)): m for m in members}
        lost = {asyncio.ensure_future(m.lost.wait()): m for m in members}
        local = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            pending = set(calls) | set(lost) | {local}
            while pending - set(lost):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task in lost:
                        raise GroupMemberFailed(lost[task], EngineLost(lost[task].name))
                    if task in calls and task.exception() is not None:
                        raise await self._blame(calls, GroupMemberFailed(calls[task], task.exception()), lost)
                    if task is local and task.exception() is not None:
                        raise await self._blame(calls, task.exception(), lost)
        finally:
            for task in (*calls, *lost):
                task.cancel()
            local.add_done_callback(lambda f: f.cancelled() or f.exception())
        log.debug("%s: done on %d server(s)", what, len(members))

    async def _blame(self, calls: dict[asyncio.Future, Member], failure: BaseException,
                     lost: dict[asyncio.Future, Member]) -> BaseException:
        """What to raise for ``failure``: the trainer's rank failing (gloo: "connection closed by peer"), or a
        server's call failing on its side of the broadcast, is often the echo of another server dying, whose
        own call fails (or which leaves routing) a moment later. Wait briefly for that, so that the dead
        server is the one named (and leaves routing); else ``failure`` itself. A failure that already names a
        lost or unreachable server is that server's."""
        if isinstance(failure, GroupMemberFailed) and isinstance(failure.cause, (*ENGINE_FAILURES, EngineLost)):
            return failure
        culprit = failure.member if isinstance(failure, GroupMemberFailed) else None

        def dead() -> BaseException | None:
            for task, member in lost.items():
                if task.done() and not task.cancelled() and member is not culprit:
                    return GroupMemberFailed(member, EngineLost(member.name))
            for task, member in calls.items():
                if member is not culprit and task.done() and not task.cancelled() \
                        and isinstance(task.exception(), ENGINE_FAILURES):
                    return GroupMemberFailed(member, task.exception())
            return None

        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(BLAME_GRACE_S, self.timeout_s)
        pending = {task for task in (*calls, *lost) if not task.done()}
        # Once every server's call has ended there is nothing more to learn: a server that died has failed its
        # call by then (a healthy server's `lost` event never fires, so it is not waited for).
        while (found := dead()) is None and any(not task.done() for task in calls):
            left = deadline - loop.time()
            if left <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
        return found or failure


__all__ = ["FleetWeightGroup", "GroupLayout", "GroupMember", "GroupMemberFailed", "TrainerRank", "plan_layout"]
