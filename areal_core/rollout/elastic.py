"""Elastic topology: which inference servers take requests, and how that set changes during a run.

The :class:`EnginePool` holds every engine the controller routes to, with
its state: ``active`` (routed), ``joining`` (started, waiting to be brought
to the current weights at the next rebuild), ``down`` (left routing for
good). The :class:`HealthMonitor` probes each engine's ``health()`` every
``interval_s``; after ``failure_threshold`` failures in a row the engine
leaves routing and the requests it had in flight are handed back to the
router, which continues them elsewhere from prompt + the output they had
before that call (the dead server's partial tokens are lost, never counted
twice). A request that fails with a connection error marks its engine
``suspect`` (skipped by routing until a probe succeeds) and counts as one
failure.

Joins go through a rebuild: the joining engines are brought to the current
weights from disk, then the topology (members and a version number) is
replaced in one step, so the trainer and the servers always agree on the
size of the weight-update group. Rebuilds are at least ``cooldown_s``
apart; weight updates and rebuilds never overlap (one lock).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

from areal_core.api.inference import InferenceEngine

log = logging.getLogger("areal.rollout")

ACTIVE, JOINING, DOWN = "active", "joining", "down"

# Between a launcher that restarts inference servers and the trainer that routes to them: the launcher lists the
# servers it restarted (host:port per line) in the file this variable names, and the trainer's rank 0 writes
# every server that leaves or joins routing as a row of EVENTS_FILE in the run folder, which the launcher shows.
LAUNCHER_DISCOVERY_ENV = "AREAL_ROLLOUT_DISCOVERY_FILE"
EVENTS_FILE = "events.jsonl"


def write_discovery_file(path: str | Path, addresses: Iterable[str]) -> None:
    """A launcher's list of the servers it restarted and that are up (``LAUNCHER_DISCOVERY_ENV``): one
    ``host:port`` per line, replaced in one step so the trainer's monitor never reads half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{address}\n" for address in addresses))
    os.replace(tmp, path)


@dataclass
class ElasticConfig:
    """How the controller watches its inference servers and lets them join and leave (``rollout.elastic``)."""

    enabled: bool = field(default=False, metadata={"help": "watch the inference servers: a failing one leaves "
                          "routing and its requests continue elsewhere; servers may join while the run is live"})
    interval_s: float = field(default=5.0, metadata={"gt": 0.0, "help": "seconds between health probes of "
                              "each inference server"})
    failure_threshold: int = field(default=3, metadata={"ge": 1, "help": "failed probes in a row after which a "
                                   "server leaves routing (its requests continue elsewhere)"})
    cooldown_s: float = field(default=30.0, metadata={"ge": 0.0, "help": "least seconds between two rebuilds "
                              "of the server set (and of the weight-update group)"})
    discovery: bool = field(default=False, metadata={"help": "read discovery_file every interval and add the "
                            "servers listed there"})
    discovery_file: str = field(default="", metadata={"help": "text file of server addresses (host:port), one "
                                "per line, read when discovery is on"})
    restarts: int = field(default=3, metadata={"ge": 0, "help": "how many times in all the launcher restarts "
                          "inference servers that exit during the run (local launcher); a restarted server "
                          "rejoins with the current weights (kept in the trainer's memory when "
                          "weight_sync=tensors). 0: a dead server is only dropped"})

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"elastic interval_s must be > 0 seconds, got {self.interval_s}")
        if self.failure_threshold < 1:
            raise ValueError(f"elastic failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"elastic cooldown_s must be >= 0 seconds, got {self.cooldown_s}")
        if self.restarts < 0:
            raise ValueError(f"elastic restarts must be >= 0, got {self.restarts}")

    def check_discovery(self) -> None:
        if self.discovery and not self.discovery_file:
            raise ValueError("rollout.elastic.discovery is on but rollout.elastic.discovery_file is empty; name the "
                             "file that lists the servers' addresses (host:port per line), or set discovery=false")


@dataclass(frozen=True)
class Topology:
    """The routed servers at one moment; ``version`` grows by one at every rebuild."""

    version: int
    members: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.members)


class NoEngineError(RuntimeError):
    """Every inference server has left routing."""


class EngineLost(Exception):
    """The engine serving a request left routing; the request continues elsewhere."""


@dataclass(eq=False)
class Member:
    engine: InferenceEngine
    name: str
    state: str = ACTIVE
    failures: int = 0  # in a row
    suspect: bool = False
    in_flight: int = 0
    served: int = 0  # requests answered
    moved: int = 0  # requests that left it unanswered (it failed or left routing) and went elsewhere
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    slot: int = 0  # its position in the pool's list: who comes first on ties
    _lost_future: asyncio.Future | None = None
    # what mark_lost ends: one callback per call in watched() (a set: adding and removing one is O(1), where
    # callbacks on a future are a list scanned on every removal)
    watchers: set = field(default_factory=set)

    def lost_future(self) -> asyncio.Future:
        """A future done once it leaves routing, shared by every request on it (a task per request waiting on
        ``lost`` cost more than the rest of the routing at hundreds of servers)."""
        if self._lost_future is None:
            self._lost_future = asyncio.get_running_loop().create_future()
            if self.lost.is_set():
                self._lost_future.set_result(None)
        return self._lost_future

    def mark_lost(self) -> None:
        self.lost.set()
        if self._lost_future is not None and not self._lost_future.done():
            self._lost_future.set_result(None)
        for end in list(self.watchers):
            end()


class Deadlines:
    """The timeouts of many waits that share one length, on one loop: their deadlines in arrival order (a FIFO,
    since the length is the same) and one loop timer, for the earliest. Whoever sets the length owns one (the
    :class:`~areal_core.rollout.interruptible.InterruptibleEngine`, for ``rollout.request_timeout_s``).

    Written by hand because asyncio has no cheaper form: ``loop.call_later`` per wait is a heap entry each, left
    in the loop's heap when cancelled, and it was a tenth of the controller's own cost at hundreds of servers
    (every request of every server waits here, again after each pause)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop, self.timeout_s = loop, timeout_s
        self.queue: deque[list] = deque()  # [deadline, wake or None once the wait is over]
        self.timer: asyncio.TimerHandle | None = None

    def add(self, wake: Callable[[], None]) -> list:
        entry = [self.loop.time() + self.timeout_s, wake]
        self.queue.append(entry)
        if self.timer is None:
            self.timer = self.loop.call_at(entry[0], self._fire)
        return entry

    def done(self, entry: list) -> None:
        entry[1] = None
        queue = self.queue
        while queue and queue[0][1] is None:  # waits mostly end in order: the queue stays short
            queue.popleft()
        if not queue and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self) -> None:
        self.timer = None
        now, queue = self.loop.time(), self.queue
        while queue and (queue[0][1] is None or queue[0][0] <= now):
            wake = queue.popleft()[1]
            if wake is not None:
                wake()
        if queue:
            self.timer = self.loop.call_at(queue[0][0], self._fire)


async def settle(member: Member, call: asyncio.Future, deadlines: Deadlines | None = None) -> bool:
    """Wait for ``call`` (a call on ``member``'s engine) until it is done, ``member`` leaves routing, or
    ``deadlines``' length passes; True when it is done.

    Otherwise, and when the waiter is itself cancelled, ``call`` is cancelled and has ended before this
    returns: a call to a server that left routing (a hung one fails its probes) never holds its caller.
    """
    lost = member.lost_future()
    if not call.done() and not lost.done():
        # asyncio.wait(FIRST_COMPLETED, timeout) written out: one waiter and two callbacks, without the sets and
        # copies it makes per call, and the timeout in a shared FIFO (Deadlines) instead of a timer per call
        waiter = asyncio.get_running_loop().create_future()

        def wake(_: Any = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        call.add_done_callback(wake)
        lost.add_done_callback(wake)
        entry = deadlines.add(wake) if deadlines is not None else None
        try:
            await waiter
        except BaseException:
            call.cancel()
            await asyncio.wait({call})
            raise
        finally:
            call.remove_done_callback(wake)
            lost.remove_done_callback(wake)
            if deadlines is not None:
                deadlines.done(entry)
    if call.done():
        return True
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    return False


class WatchEnded(Exception):
    """What :func:`watched` raises when the server left routing (``reason`` "lost") or the time ran out
    ("timeout") before the call finished; the call was cancelled and has ended."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Task.uncancel (3.11) tells our own cancellation from a caller's; without it, calls run in a task of their own
INLINE_CALLS = hasattr(asyncio.Task, "uncancel")


async def watched(member: Member, call: Awaitable[Any], deadlines: Deadlines | None = None) -> Any:
    """``await call`` (a call on ``member``'s engine) in the calling task, cancelled in place when ``member`` leaves
    routing or ``deadlines``' length passes (then :class:`WatchEnded`): what :func:`settle` does without a task per call (on
    Python 3.11+; every request of every server passes here, and a task each was the largest single cost of the
    controller at hundreds of servers). A cancellation from outside still arrives as ``CancelledError``."""
    task = asyncio.current_task()
    if member.lost.is_set():
        if asyncio.iscoroutine(call):
            call.close()
        raise WatchEnded("lost")
    why: list[str] = []

    def end(reason: str) -> None:  # called only while the call runs: finally below takes both triggers away
        if not why:
            why.append(reason)
            task.cancel()

    def on_lost() -> None:
        end("lost")

    member.watchers.add(on_lost)
    entry = deadlines.add(lambda: end("timeout")) if deadlines is not None else None
    try:
        result = await call
    except asyncio.CancelledError:
        if why and task.uncancel() == 0:  # ours alone: the call is over, say why
            raise WatchEnded(why[0]) from None
        raise
    except BaseException:
        if why:  # the call turned our cancellation into an error of its own: that error stands, ours is spent
            task.uncancel()
        raise
    finally:
        member.watchers.discard(on_lost)
        if deadlines is not None:
            deadlines.done(entry)
    if why:  # the call finished before our cancellation reached it: its answer stands
        task.uncancel()
    return result


def engine_name(engine: InferenceEngine, index: int) -> str:
    address = getattr(engine, "address", None)
    return f"{address}" if address else f"{type(engine).__name__}-{index}"


class EnginePool:
    """The engines the router may use, and the topology they form. Lives on the controller's loop."""

    def __init__(self, engines: list[InferenceEngine], config: ElasticConfig | None = None,
                 on_event: Callable[[str, str, str], None] | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        if not engines:
            raise ValueError("the rollout controller needs at least one inference engine")
        self.config = config
        self.on_event = on_event  # (kind: "left" / "joined" / "failed to join", server, why): e.g. to the terminal
        self.members = [Member(e, engine_name(e, i), slot=i) for i, e in enumerate(engines)]
        self.topology = Topology(0, tuple(m.name for m in self.members))
        self.lock = asyncio.Lock()  # weight updates and rebuilds
        self.changed = asyncio.Event()  # set whenever routing may have gained an engine
        self.now = now  # the controller's clock (areal_core.clock): cooldowns and waits on the loop use it
        self.last_rebuild = now()
        self.events: list[tuple[float, str, str]] = []  # (time, "left" / "joined", name): for logs and tests
        self._closing: set[asyncio.Task] = set()  # clients of servers that left, being closed
        # Routing: a heap of (in_flight, slot, member) entries, stale ones dropped when they reach the top and
        # the whole heap rebuilt when the set of routable members changes; pick() is O(log n), not O(n).
        self._heap: list[tuple[int, int, Member]] = []
        self._heap_dirty = True
        self.in_flight = 0  # requests inside an engine call, over every member
        self.idle = asyncio.Event()  # set while none is
        self.idle.set()

    # -------------------------------------------------------------- routing
    @property
    def elastic(self) -> bool:
        return self.config is not None

    def active(self) -> list[Member]:
        return [m for m in self.members if m.state == ACTIVE]

    def pick(self) -> Member | None:
        """The routable engine with the fewest requests in flight (first on ties); None when there is none."""
        heap = self._heap
        if self._heap_dirty or len(heap) > 4 * len(self.members) + 64:
            heap[:] = [(m.in_flight, m.slot, m) for m in self.members if m.state == ACTIVE and not m.suspect]
            heapq.heapify(heap)
            self._heap_dirty = False
        while heap:
            in_flight, _, member = heap[0]
            if member.in_flight == in_flight and member.state == ACTIVE and not member.suspect:
                return member
            heapq.heappop(heap)
        return None

    def routing_changed(self) -> None:
        """A member's state or suspicion changed: the next pick looks at every member again."""
        self._heap_dirty = True

    def acquire(self, member: Member) -> None:
        """One more request in flight on ``member``."""
        member.in_flight += 1
        self.in_flight += 1
        self.idle.clear()
        heapq.heappush(self._heap, (member.in_flight, member.slot, member))

    def release(self, member: Member) -> None:
        member.in_flight -= 1
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
        heapq.heappush(self._heap, (member.in_flight, member.slot, member))

    @property
    def version(self) -> int:
        active = self.active()
        return min(m.engine.version for m in active) if active else 0

    # -------------------------------------------------------------- failures
    def report_failure(self, member: Member, why: str, *, request: bool = False) -> None:
        if member.state == DOWN:
            return
        member.failures += 1
        member.suspect = member.suspect or request
        self.routing_changed()
        threshold = self.config.failure_threshold if self.config else 1
        log.warning("inference server %s failed (%d in a row of %d allowed): %s", member.name, member.failures,
                    threshold, why)
        if member.failures >= threshold:
            self.remove(member, f"{member.failures} failures in a row; the last: {why}")

    def report_success(self, member: Member) -> None:
        member.failures = 0
        if member.suspect:
            member.suspect = False
            self.routing_changed()
            self.changed.set()

    def remove(self, member: Member, why: str) -> None:
        """Take ``member`` out of routing now; the requests it serves continue elsewhere."""
        if member.state == DOWN:
            return
        was_member = member.state == ACTIVE
        member.state = DOWN
        member.mark_lost()
        self.routing_changed()
        self.events.append((self.now(), "left", member.name))
        log.warning("inference server %s left routing (%s); %d request(s) it was serving continue elsewhere",
                    member.name, why, member.in_flight)
        if was_member:
            self.topology = Topology(self.topology.version + 1, tuple(m.name for m in self.active()))
        self._close_later(member.engine)
        self._tell("left", member.name, f"{why}; {member.in_flight} request(s) it was serving continue elsewhere, "
                                        f"{len(self.active())} server(s) left in routing")

    def _tell(self, kind: str, name: str, why: str) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(kind, name, why)
        except Exception as exc:  # a report that fails must not change routing
            log.warning("reporting that inference server %s %s failed: %s", name, kind, exc)

    def _close_later(self, engine: InferenceEngine) -> None:
        task = asyncio.get_running_loop().create_task(_close_quietly(engine))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def wait_for_engine(self, timeout_s: float, what: str) -> Member:
        """A routable engine, waiting (up to ``timeout_s``) while none is."""
        deadline = self.now() + timeout_s
        while (member := self.pick()) is None:
            if not self.elastic or not any(m.state != DOWN for m in self.members):
                raise NoEngineError(f"no inference server is left to {what}: every one failed "
                                    f"({', '.join(m.name for m in self.members)}); see their logs")
            remaining = deadline - self.now()
            if remaining <= 0:
                raise TimeoutError(f"waited {timeout_s:.0f} s (rollout.request_timeout_s) for a healthy inference "
                                   f"server to {what}; none of {', '.join(m.name for m in self.members)} is")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
        return member

    # -------------------------------------------------------------- joins
    def add(self, engine: InferenceEngine) -> Member:
        member = Member(engine, engine_name(engine, len(self.members)), state=JOINING, slot=len(self.members))
        if any(m.name == member.name and m.state != DOWN for m in self.members):
            raise ValueError(f"inference server {member.name} is already in the pool")
        self.members.append(member)
        return member

    def joining(self) -> list[Member]:
        return [m for m in self.members if m.state == JOINING]

    def cooldown_left(self) -> float:
        cooldown = self.config.cooldown_s if self.config else 0.0
        return max(0.0, self.last_rebuild + cooldown - self.now())

    async def rebuild(self, bring_up: Callable[[InferenceEngine], Awaitable[None]]) -> Topology:
        """Bring every joining engine to the current weights, then make them members: one new topology.

        Call with ``self.lock`` held. A joiner that fails to come up is dropped (logged), never routed.
        """
        joiners = self.joining()
        results = await asyncio.gather(*(bring_up(m.engine) for m in joiners), return_exceptions=True)
        for member, result in zip(joiners, results):
            if isinstance(result, BaseException):
                member.state = DOWN
                log.error("inference server %s could not join: %s: %s", member.name, type(result).__name__, result)
                self._close_later(member.engine)
                self._tell("failed to join", member.name, f"{type(result).__name__}: {result}")
                continue
            member.state = ACTIVE
            self.routing_changed()
            self.events.append((self.now(), "joined", member.name))
        self.topology = Topology(self.topology.version + 1, tuple(m.name for m in self.active()))
        for member in joiners:
            if member.state == ACTIVE:
                self._tell("joined", member.name, f"at version {member.engine.version}; {self.topology.size} "
                                                  f"server(s) in routing")
        self.last_rebuild = self.now()
        self.changed.set()
        log.info("inference servers rebuilt: topology version %d, %d member(s): %s", self.topology.version,
                 self.topology.size, ", ".join(self.topology.members))
        return self.topology


async def _close_quietly(engine: InferenceEngine) -> None:
    try:
        await engine.aclose()
    except Exception as exc:  # a dead server's client may fail to close; nothing else to do
        log.debug("closing %s failed: %s", type(engine).__name__, exc)


class HealthMonitor:
    """Probes every engine at ``interval_s``, removes failing ones, rebuilds when engines wait to join."""

    def __init__(self, pool: EnginePool, bring_up: Callable[[InferenceEngine], Awaitable[None]],
                 discover: Callable[[str], InferenceEngine] | None = None,
                 launcher_file: str | None = None) -> None:
        if pool.config is None:
            raise ValueError("HealthMonitor needs an EnginePool with an ElasticConfig")
        pool.config.check_discovery()
        self.pool, self.config = pool, pool.config
        self.bring_up = bring_up
        self.discover = discover
        # The launcher's own list of the servers it (re)started (AREAL_ROLLOUT_DISCOVERY_FILE), read beside
        # the user's discovery_file whether or not discovery is on.
        self.launcher_file = launcher_file
        self.probes = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.config.interval_s)

    async def tick(self) -> None:
        """One round: probe, discover, rebuild if engines are waiting and the cooldown has passed."""
        await self.probe()
        if self.discover is not None:
            if self.config.discovery:
                self.read_discovery_file()
            if self.launcher_file:
                self.read_discovery_file(self.launcher_file)
        if self.pool.joining() and self.pool.cooldown_left() == 0 and not self.pool.lock.locked():
            async with self.pool.lock:
                await self.pool.rebuild(self.bring_up)

    async def probe(self) -> None:
        members = [m for m in self.pool.members if m.state == ACTIVE]
        results = await asyncio.gather(*(self._probe_one(m) for m in members))
        self.probes += 1
        for member, (ok, why) in zip(members, results):
            if ok:
                self.pool.report_success(member)
            else:
                self.pool.report_failure(member, why)

    async def _probe_one(self, member: Member) -> tuple[bool, str]:
        try:
            ok = await asyncio.wait_for(member.engine.health(), self.config.interval_s)
        except asyncio.TimeoutError:
            return False, f"health() did not answer within {self.config.interval_s:g} s"
        except Exception as exc:
            return False, f"health() raised {type(exc).__name__}: {exc}"
        return bool(ok), "health() returned False"

    def read_discovery_file(self, file: str | None = None) -> None:
        """Add every server listed in ``file`` (default: ``discovery_file``) that is not in the pool or left it."""
        path = Path(file or self.config.discovery_file)
        try:
            lines = path.read_text().split()
        except FileNotFoundError:
            return
        known = {m.name for m in self.pool.members if m.state != DOWN}
        for address in dict.fromkeys(line.strip() for line in lines if line.strip()):
            if address not in known:
                log.info("discovered inference server %s in %s", address, path)
                self.pool.add(self.discover(address))


__all__ = ["EVENTS_FILE", "LAUNCHER_DISCOVERY_ENV", "ElasticConfig", "EngineLost", "EnginePool", "HealthMonitor", "Member", "NoEngineError", "Topology",
           "settle"]

