"""The rollout controller: many episodes in flight on one asyncio loop,
admitted under the staleness bound, handed to the trainer as batches.

The trainer is ordinary synchronous code; the controller runs its event loop
in a background thread and the trainer calls the thread-safe methods here
(``submit``, ``wait``, ``prepare_batch``, ``pause``, ``resume``,
``update_weights``). Workflows run as asyncio tasks on that loop; sync
rewards they call through :func:`areal_core.api.call_reward` run in the
loop's default executor, a thread pool, never on the loop itself.

The staleness rule. An episode admitted while the engines serve version
``s`` must be trained by version ``s + eta``. Admission (see
:mod:`areal_core.rollout.staleness`) keeps the number of episodes due by any
version within the batches that exist until then; batches are handed out
earliest-deadline-first (oldest ready groups first), and a batch waits for a
still-running episode only when leaving it behind would make some later batch
unable to take everything due by then. So every trained sample obeys
``v - start_version <= eta``, and fast episodes still overtake slow ones
whenever there is slack.

Two versions are kept apart. Episodes are stamped with the version the
engines serve (``version``); a batch is decided by the version it will be
*trained* at. While a non-blocking update is loading (the trainer at
eta > 0 trains its next batch meanwhile) the second is one ahead of the
first: ``update_weights`` records its target at once, and ``prepare_batch``
takes the trainer's version explicitly, so the hand-out never decides with a
version that lags.
With ``eta = 0`` the controller is an ordinary synchronous trainer: batch
``k`` is exactly the ``k``-th block of ``batch_size`` items.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Iterable, Iterator

from areal_core.api.inference import InferenceEngine
from areal_core.api.workflow import Workflow
from areal_core.rollout.batch import EpisodeGroup
from areal_core.pending import PendingCall
from areal_core.rollout.elastic import (DOWN, JOINING, ElasticConfig, EngineLost, EnginePool, HealthMonitor, Member,
                                         NoEngineError, Topology, settle)
from areal_core.rollout.interruptible import ENGINE_FAILURES, InterruptibleEngine
from areal_core.rollout.weight_group import FleetWeightGroup, GroupMemberFailed
from areal_core.rollout.staleness import StalenessManager
from areal_core.threads import serial_torch

ShouldAccept = Callable[[EpisodeGroup], bool]


class RolloutError(RuntimeError):
    """A workflow raised; the message names the workflow and the item."""


class StallError(RuntimeError):
    """The data source ran dry before a batch could be filled."""


def has_reward_variance(group: EpisodeGroup) -> bool:
    """A ``should_accept`` for dynamic filtering: False when every reward in the
    group is the same, which gives no signal under a group baseline."""
    return len(set(group.rewards)) > 1


class RolloutController:
    def __init__(
        self,
        engines: list[InferenceEngine],
        workflow: Workflow,
        *,
        batch_size: int,
        max_head_offpolicyness: int = 0,
        max_concurrent_rollouts: int = 64,
        should_accept: ShouldAccept | None = None,
        request_timeout_s: float = 600.0,
        reward_workers: int = 4,
        call_timeout_s: float = 600.0,
        elastic: ElasticConfig | None = None,
        engine_factory: Callable[[str], InferenceEngine] | None = None,
        pacing: bool = False,
        on_topology_event: Callable[[str, str, str], None] | None = None,
        launcher_discovery_file: str | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.eta = max_head_offpolicyness
        self.staleness = StalenessManager(batch_size, max_head_offpolicyness, max_concurrent_rollouts, pacing)
        self._initial_engines = list(engines)
        self.elastic = elastic if elastic is None or elastic.enabled else None
        self.engine_factory = engine_factory  # address -> engine, for add_server() and discovery
        self.pool: EnginePool | None = None
        self.monitor: HealthMonitor | None = None
        self._weights_path: str | None = None  # the latest weights on disk: joining servers load them
        # ... or, elastic with weight_sync=tensors, the latest tensors themselves (copies the trainer handed over)
        self._weights_tensors: list | None = None
        self._started_engines: set[int] = set()  # ids of engines whose start() ran (discovered ones start late)
        self.on_topology_event = on_topology_event  # (kind, server, why) when a server leaves or joins routing
        self.launcher_discovery_file = launcher_discovery_file  # servers the launcher restarted, one per line
        self.weight_group: FleetWeightGroup | None = None  # one group over every routed server, when they share one
        self.workflow = workflow
        self.should_accept = should_accept
        self.request_timeout_s = request_timeout_s
        self.call_timeout_s = call_timeout_s
        self._reward_workers = reward_workers
        self._cond = threading.Condition()
        self._version = 0  # the version the engines serve: episodes are stamped with it
        self._target_version = 0  # the newest version handed to update_weights (ahead while engines load)
        self._restored_version = 0  # load_state_dict's: admission waits until the engines serve it
        self._pending: deque[tuple[int, Any]] = deque()
        self._running: dict[int, int] = {}  # seq -> start version
        self._ready: list[tuple[int, int, EpisodeGroup]] = []  # heap of (start_version, seq, group)
        self._source: Iterator[Any] | None = None
        self._source_obj: Any = None
        self._source_done = False
        self._next_seq = 0
        self._done_watermark = 0  # every seq below it is consumed or rejected
        self._done_extra: set[int] = set()
        self._consumed_accepted = 0
        self._generated_tokens = 0  # by every finished episode, accepted or not
        self._resumed_watermark = 0  # items done before a resume are skipped when pulled again
        self._resumed_extra: set[int] = set()
        self._error: BaseException | None = None
        self._paused = False
        self._stopped = False  # stop_rollouts(): no more training episodes
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine: InterruptibleEngine | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> RolloutController:
        if self._thread is not None:
            return self
        ready = threading.Event()

        def run() -> None:
            # Torch work here (weight staging, collectives) must not form a second OpenMP team beside the
            # training thread's: see areal_core.threads.
            serial_torch()
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.set_default_executor(ThreadPoolExecutor(self._reward_workers, thread_name_prefix="areal-reward",
                                                         initializer=serial_torch))
            self._loop = loop
            self.pool = EnginePool(self._initial_engines, self.elastic, self.on_topology_event)
            self.engine = InterruptibleEngine(self.pool, self.request_timeout_s)
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        self._thread = threading.Thread(target=run, name="areal-rollout", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise TimeoutError("waited 30 s for the rollout controller's event loop thread to start")

        async def start_engines() -> None:
            await asyncio.gather(*(e.start() for e in self._initial_engines))
            self._started_engines.update(id(e) for e in self._initial_engines)
            if self.elastic is not None:
                discover = self._engine_for if self.engine_factory is not None else None
                self.monitor = HealthMonitor(self.pool, self._bring_up, discover, self.launcher_discovery_file)
                self.monitor.start()

        self._call(start_engines(), f"start {len(self._initial_engines)} inference engine(s)")
        return self

    def close(self) -> None:
        """Cancel every episode and stop the loop thread; idempotent."""
        if self._loop is None or self._thread is None:
            return
        loop, self._loop = self._loop, None

        async def shutdown() -> None:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.monitor is not None:
                await self.monitor.stop()
            if self.weight_group is not None:
                await self.weight_group.drop(self.pool.active())
            # what is left (evaluation episodes, their engine calls) ends before the loop does
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await asyncio.gather(*(m.engine.aclose() for m in self.pool.members), return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(self.call_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"waited {self.call_timeout_s:.0f} s for episodes to cancel and "
                               "inference engines to close") from None
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(self.call_timeout_s)
            self._thread = None

    def __enter__(self) -> RolloutController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Awaitable[Any], what: str) -> Any:
        return self._begin(coro, what).result()

    def _begin(self, coro: Awaitable[Any], what: str) -> "PendingCall":
        if self._loop is None:
            coro.close()
            raise RuntimeError("the rollout controller is not started; call start() first")
        return PendingCall(asyncio.run_coroutine_threadsafe(coro, self._loop), self.call_timeout_s,
                           f"the rollout controller to {what}")

    def _kick(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._admit)

    # ------------------------------------------------------------ input
    @property
    def version(self) -> int:
        return self._version

    def _require_restored_weights(self) -> None:
        if self._version < self._restored_version:
            raise RuntimeError(
                f"the rollout controller was restored at version {self._restored_version} but the engines serve "
                f"version {self._version}: hand them the restored weights (update_weights_from_disk / "
                f"update_weights_from_tensors with version {self._restored_version}) before submitting items")

    def submit(self, item: Any) -> None:
        """Queue one item (one prompt group); it starts when admission allows."""
        self._require_restored_weights()
        with self._cond:
            self._pending.append((self._next_seq, item))
            self._next_seq += 1
        self._kick()

    def set_source(self, source: Iterable[Any]) -> None:
        """Pull items from ``source`` whenever admission allows (used by ``prepare_batch``)."""
        self._require_restored_weights()
        with self._cond:
            self._source_obj = source
            self._source = iter(source)
            self._source_done = False
        self._kick()

    def _next_item(self) -> tuple[int, Any] | None:
        if self._pending:
            return self._pending.popleft()
        while self._source is not None and not self._source_done:
            try:
                item = next(self._source)
            except StopIteration:
                self._source_done = True
                self._cond.notify_all()
                return None
            seq = self._next_seq
            self._next_seq += 1
            if seq >= self._resumed_watermark and seq not in self._resumed_extra:
                return seq, item
        return None

    # ------------------------------------------------------------ the loop side
    def _admit(self) -> None:
        with self._cond:
            while (not self._paused and not self._stopped and self._error is None
                   and self.staleness.capacity(self._version) > 0):
                nxt = self._next_item()
                if nxt is None:
                    break
                seq, item = nxt
                self.staleness.on_start()
                self._running[seq] = self._version
                task = asyncio.get_running_loop().create_task(self._episode(seq, item, self._version))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _episode(self, seq: int, item: Any, start_version: int) -> None:
        admitted = time.monotonic()
        try:
            result = await self.workflow.arun_episode(self.engine, item)
            group = None
            if result is not None:
                group = EpisodeGroup(seq, item, start_version, list(result), admitted, time.monotonic())
                self._generated_tokens += group.generated_tokens()
                if self.should_accept is not None and not self.should_accept(group):
                    group = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            with self._cond:
                if self._error is None:
                    err = RolloutError(f"workflow {type(self.workflow).__name__} failed on item #{seq} "
                                       f"({_short(item)}): {type(exc).__name__}: {exc}")
                    err.__cause__ = exc
                    self._error = err
                self._cond.notify_all()
            return
        with self._cond:
            del self._running[seq]
            if group is None:
                self.staleness.on_reject()
                self._mark_done(seq)
            else:
                self.staleness.on_accept()
                heapq.heappush(self._ready, (start_version, seq, group))
            self._cond.notify_all()
        self._admit()

    def _mark_done(self, seq: int) -> None:
        self._done_extra.add(seq)
        while self._done_watermark in self._done_extra:
            self._done_extra.discard(self._done_watermark)
            self._done_watermark += 1

    # ------------------------------------------------------------ output
    def _train_version(self, version: int | None) -> int:
        """The version a batch handed out now is trained at: the caller's, else the newest the engines serve
        or are loading."""
        return max(self._version, self._target_version) if version is None else version

    def _can_hand_out(self, count: int, version: int) -> bool:
        """Whether the ``count`` oldest ready groups may form the batch trained at ``version`` (the staleness
        bound's hand-out rule: :meth:`StalenessManager.may_hand_out`)."""
        return self.staleness.may_hand_out(sorted(entry[0] for entry in self._ready), list(self._running.values()),
                                           count, version)

    def _stalled(self, count: int) -> bool:
        return (self._source_done or self._source is None) and not self._pending and not self._running \
            and len(self._ready) < count

    def wait(self, count: int, timeout: float | None = None, version: int | None = None) -> list[EpisodeGroup]:
        """Block until ``count`` accepted groups can be handed out; oldest first.

        ``version``: the policy version the groups will be trained at (default: the newest version the
        engines serve or are loading, see :meth:`update_weights`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if self._can_hand_out(count, self._train_version(version)):
                    groups = [heapq.heappop(self._ready)[2] for _ in range(count)]
                    for g in groups:
                        self._mark_done(g.seq)
                    self._consumed_accepted += count
                    return groups
                if self._stalled(count):
                    c = self.staleness.counts
                    raise StallError(
                        f"the data source ran dry: a batch needs {count} accepted groups but only "
                        f"{len(self._ready)} are ready, none running; {c.started} episodes started, "
                        f"{c.rejected} rejected by the workflow or should_accept. Fix: give the dataset "
                        f"more items (or more epochs), or accept more groups (e.g. dynamic filtering off)"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"waited {timeout:.0f} s for {count} accepted rollout groups: "
                                       + self._describe())
                self._cond.wait(remaining if remaining is not None else 1.0)

    def prepare_batch(self, dataloader: Iterable[Any], timeout: float | None = None,
                      version: int | None = None) -> list[EpisodeGroup]:
        """The next batch of ``batch_size`` groups, drawing items from ``dataloader`` as admission allows.

        Keep passing the same dataloader: it is iterated once, lazily, across calls. ``version``: the
        policy version the batch will be trained at (the trainer passes its own; see :meth:`wait`).
        """
        if dataloader is not self._source_obj:
            self.set_source(dataloader)
        with self._cond:
            ready, waited = len(self._ready), not self._can_hand_out(self.batch_size, self._train_version(version))
            first = self._consumed_accepted == 0  # nothing could have been generated ahead of it
        groups = self.wait(self.batch_size, timeout, version)
        with self._cond:
            grew = self.staleness.on_hand_out(waited and not first, ready)
        if grew:
            self._kick()
        return groups

    def _describe(self) -> str:
        c = self.staleness.counts
        return (f"{len(self._ready)} ready, {len(self._running)} running, {len(self._pending)} queued, "
                f"{c.rejected} rejected, version {self._version}, paused={self._paused}, "
                f"admission capacity {self.staleness.capacity(self._version)}")

    # ------------------------------------------------------------ weights
    def set_version(self, version: int) -> None:
        """Declare the version the engines serve now (no update runs: the caller vouches for it)."""
        with self._cond:
            self._version = self._target_version = version
            self._cond.notify_all()
        self._kick()

    def pause(self) -> None:
        """Stop admitting; engines abort in-flight requests, which wait to be continued."""
        self._call(self._pause(), "pause generation")

    def resume(self) -> None:
        self._call(self._resume(), "resume generation")

    async def _pause(self) -> None:
        with self._cond:
            self._paused = True
        self.engine.close_gate()
        if all("pause" in e.capabilities for e in self.engines):
            await self._on_members(lambda e: e.pause(), "pause")
        else:  # no interruption: let requests in flight finish under the old weights
            while self.engine.in_flight:
                await asyncio.sleep(0.001)

    async def _resume(self) -> None:
        if all("pause" in e.capabilities for e in self.engines):
            await self._on_members(lambda e: e.resume(), "resume")
        with self._cond:
            self._paused = False
        self.engine.open_gate()
        self._admit()

    async def _on_members(self, call: Callable[[InferenceEngine], Awaitable[Any]], what: str) -> None:
        """``call`` on every routed engine at once. Elastic: an engine that fails leaves routing
        (it would serve stale weights); otherwise the first failure is raised."""
        async def on(member: Member) -> Any:
            if self.elastic is None:
                return await call(member.engine)
            # A server that hangs here is removed by its failed probes; the others go on without it.
            task = asyncio.ensure_future(call(member.engine))
            if await settle(member, task):
                return task.result()
            raise EngineLost(member.name)

        members = self.pool.active()
        results = await asyncio.gather(*(on(m) for m in members), return_exceptions=True)
        for member, result in zip(members, results):
            if isinstance(result, EngineLost):
                continue  # it left routing during the call
            if isinstance(result, BaseException):
                if self.elastic is None or not isinstance(result, ENGINE_FAILURES):
                    raise result
                self.pool.remove(member, f"{what} failed: {type(result).__name__}: {result}")

    def update_weights(self, apply: Callable[[], Awaitable[Any]], version: int,
                       wait: bool = True) -> "float | PendingCall":
        """Pause, run ``apply()`` on the loop, set ``version``, resume; nothing else inside the pause.

        Returns the seconds generation was paused; with ``wait=False`` at once,
        a :class:`PendingCall` whose ``result()`` gives them. Episodes are
        stamped with the version the engines serve, which moves only once they
        have loaded; a batch taken meanwhile is decided by ``version`` (recorded
        here before the call returns), so a caller going on while the servers
        load (the trainer at eta > 0) never gets a sample staler than the bound.
        """
        with self._cond:
            self._target_version = max(self._target_version, version)

        async def swap() -> float:
            began = time.monotonic()
            async with self.pool.lock:  # never beside a rebuild of the server set
                await self._pause()
                try:
                    await apply()
                    with self._cond:
                        self._version = version
                        self._cond.notify_all()
                finally:
                    await self._resume()
            return time.monotonic() - began

        what = f"update weights to version {version}"
        return self._call(swap(), what) if wait else self._begin(swap(), what)

    def update_weights_from_disk(self, path: str, version: int, wait: bool = True) -> "float | PendingCall":
        async def apply() -> None:
            await self._on_members(lambda e: e.update_weights_from_disk(path, version), "update_weights_from_disk")
            self._weights_path, self._weights_tensors = str(path), None

        return self.update_weights(apply, version, wait)

    def update_weights_from_tensors(self, named_tensors: list, version: int,
                                    wait: bool = True) -> "float | PendingCall":
        """Hand ``named_tensors`` ((name, tensor) pairs, full weights) to every routed engine; see
        :meth:`update_weights` (with ``wait=False`` the tensors must stay unchanged until the call is done).

        Engines whose class offers ``fleet_weight_group(engines)`` (every routed one) share ONE weight-update
        group, rebuilt at each topology version (:mod:`areal_core.rollout.weight_group`): each bucket is
        broadcast once for all. Others take the tensors one engine at a time. Elastic: an engine that fails
        leaves routing, as with disk updates; over a shared group the update then starts again over the
        group of the servers left, never waiting for the one that failed.
        """
        async def apply() -> None:
            group = self._shared_weight_group()
            if group is None:
                await self._on_members(lambda e: e.update_weights_from_tensors(named_tensors, version),
                                       "update_weights_from_tensors")
            else:
                await self._update_over_group(group, named_tensors, version)
            self._weights_path = None  # the weights now loaded are on no disk
            # A joiner (a restarted server) takes these; kept only when servers may join (one model's copy)
            self._weights_tensors = list(named_tensors) if self.elastic is not None else None

        return self.update_weights(apply, version, wait)

    def _shared_weight_group(self) -> FleetWeightGroup | None:
        """The fleet's weight-update group when every routed engine is of one class that offers the hook."""
        kinds = {type(m.engine) for m in self.pool.active()}
        hook = getattr(next(iter(kinds)), "fleet_weight_group", None) if len(kinds) == 1 else None
        if hook is None:
            return None
        if self.weight_group is None:
            self.weight_group = hook([m.engine for m in self.pool.active()])
        return self.weight_group

    async def _update_over_group(self, group: FleetWeightGroup, named_tensors: Any, version: int) -> None:
        named = named_tensors if isinstance(named_tensors, (list, tuple)) else list(named_tensors)  # may go twice
        for _ in range(len(self.pool.members) + 1):  # each retry follows a server leaving: bounded
            members = self.pool.active()
            if not members:
                raise NoEngineError(f"no inference server is left to take the weights of version {version}")
            try:
                await group.update(members, self.pool.topology.version, named, version)
                return
            except GroupMemberFailed as failed:
                cause = failed.cause
                if self.elastic is None or not isinstance(cause, (*ENGINE_FAILURES, EngineLost)):
                    raise cause from None
                self.pool.remove(failed.member, f"update_weights_from_tensors failed: {type(cause).__name__}: "
                                                f"{cause}")  # a new topology version: the next try rebuilds
        raise RuntimeError(f"update_weights_from_tensors to version {version} failed on every inference server")

    # ------------------------------------------------------------ elastic topology
    @property
    def engines(self) -> list[InferenceEngine]:
        """The engines now routed to (before start: the ones given)."""
        return self._initial_engines if self.pool is None else [m.engine for m in self.pool.active()]

    @property
    def topology(self) -> Topology:
        """The routed servers and the topology version: the weight-update group's size is ``topology.size``."""
        if self.pool is None:
            raise RuntimeError("the rollout controller is not started; call start() first")
        return self.pool.topology

    def _engine_for(self, address: str) -> InferenceEngine:
        if self.engine_factory is None:
            raise ValueError(f"cannot add the inference server at {address}: the controller was built without an "
                             "engine_factory (address -> engine); pass the engine itself to add_engine()")
        return self.engine_factory(address)

    async def _bring_up(self, engine: InferenceEngine) -> None:
        """Start a joining engine (a discovered one was only built) and bring it to the current weights, from
        disk or from the latest tensors, before it takes traffic."""
        if id(engine) not in self._started_engines:
            await engine.start()
            self._started_engines.add(id(engine))
        if engine.version == self._version:
            return
        if self._weights_path is not None:
            await engine.update_weights_from_disk(self._weights_path, self._version)
        elif self._weights_tensors is not None and "update_weights_from_tensors" in engine.capabilities:
            await engine.update_weights_from_tensors(self._weights_tensors, self._version)
        else:
            raise RuntimeError(f"a server joining at version {self._version} (it has {engine.version}) needs the "
                               "current weights, but they are on no disk and no tensors of them are kept (no "
                               "update yet, or the engine does not take tensors); use rollout.weight_sync=disk")

    def add_engine(self, engine: InferenceEngine, timeout_s: float | None = None) -> Topology:
        """Add a live server: start its client, bring it to the current weights at the next rebuild
        (after the cooldown), then route to it. Returns the topology it joined; raises if it could not."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s

        async def join() -> Topology:
            await engine.start()
            self._started_engines.add(id(engine))
            member = self.pool.add(engine)
            deadline = time.monotonic() + timeout_s
            while member.state == JOINING:
                if self.pool.cooldown_left() == 0 and not self.pool.lock.locked():
                    async with self.pool.lock:
                        if member.state == JOINING:
                            await self.pool.rebuild(self._bring_up)
                    continue
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"waited {timeout_s:.0f} s for inference server {member.name} to join "
                                       f"(cooldown left {self.pool.cooldown_left():.0f} s)")
                await asyncio.sleep(min(0.2, max(0.01, self.pool.cooldown_left())))
            if member.state == DOWN:
                raise RuntimeError(f"inference server {member.name} could not join; see the log above")
            self._kick()
            return self.pool.topology

        return self._call(join(), f"add inference server {getattr(engine, 'address', type(engine).__name__)}")

    def add_server(self, address: str, timeout_s: float | None = None) -> Topology:
        """Add the server at ``address`` (host:port) through ``engine_factory``; see :meth:`add_engine`."""
        return self.add_engine(self._engine_for(address), timeout_s)

    def members(self) -> list[Member]:
        """Every server the controller has routed to, with its state and counters (for logs and tests)."""
        return list(self.pool.members) if self.pool is not None else []

    # ------------------------------------------------------------ state
    def stop_rollouts(self) -> int:
        """Admit no more training episodes and cancel the running ones (the run is over); returns how many.

        Cancelled episodes count as not done, so a checkpoint taken afterwards
        still has them redone on resume. Evaluation keeps working.
        """
        with self._cond:
            self._stopped = True

        async def cancel() -> int:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return len(tasks)

        return self._call(cancel(), "cancel the running training episodes")

    def evaluate(self, workflow: Workflow, items: list[Any], concurrency: int = 32) -> concurrent.futures.Future:
        """Run ``workflow`` on ``items`` beside the training rollouts; a future of each item's result.

        Evaluation episodes share the engines (and their interruptions at
        weight updates) with training episodes but not the staleness
        accounting: nothing they produce is trained on. The future holds one
        entry per item, in order: its trajectories, None when the workflow
        rejected it, or the exception it raised.
        """
        if self._loop is None:
            raise RuntimeError("the rollout controller is not started; call start() first")

        async def run_all() -> list[Any]:
            gate = asyncio.Semaphore(concurrency)

            async def one(item: Any) -> Any:
                async with gate:
                    return await workflow.arun_episode(self.engine, item)

            return await asyncio.gather(*(one(item) for item in items), return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(run_all(), self._loop)

    def stats(self) -> dict[str, int]:
        with self._cond:
            c = self.staleness.counts
            servers = len(self.pool.active()) if self.pool is not None else len(self._initial_engines)
            return {"version": self._version, "queued": len(self._pending), "running": len(self._running),
                    "servers": servers,
                    "ready": len(self._ready), "started": c.started, "accepted": c.accepted,
                    "rejected": c.rejected, "consumed": self._consumed_accepted, "lead": self.staleness.lead,
                    "generated_tokens": self._generated_tokens}

    def state_dict(self) -> dict:
        """What resume needs: the version, the staleness counters as if nothing were in
        flight (in-flight episodes are redone after resume), and which items are done."""
        with self._cond:
            return {"version": self._version, "consumed": self._consumed_accepted,
                    "rejected": self.staleness.counts.rejected,
                    "done_watermark": self._done_watermark, "done_extra": sorted(self._done_extra)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters and done items of :meth:`state_dict`, before anything is submitted.

        The version the engines serve is not restored: they serve what they loaded (at a restart, the base
        model). Hand them the restored weights (``update_weights_from_*`` with the saved version) before any
        item is submitted; until then :meth:`submit` and :meth:`prepare_batch` refuse, so no episode is
        stamped with a version its tokens do not come from."""
        with self._cond:
            if self._running or self._ready or self._next_seq:
                raise RuntimeError("load_state_dict must be called before any item is submitted")
            self._restored_version = state["version"]
            self._consumed_accepted = state["consumed"]
            self.staleness.load_state_dict({"started": state["consumed"] + state["rejected"], "running": 0,
                                            "accepted": state["consumed"], "rejected": state["rejected"]})
            self._done_watermark = state["done_watermark"]
            self._done_extra = set(state["done_extra"])
            self._resumed_watermark = self._done_watermark
            self._resumed_extra = set(self._done_extra)


def _short(item: Any, limit: int = 80) -> str:
    text = repr(item)
    return text if len(text) <= limit else text[: limit - 3] + "..."
