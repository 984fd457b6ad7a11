"""The fleet: the inference engines the controller routes to, and the weights they serve.

This part owns the engines (the :class:`EnginePool` and, elastic, its
:class:`HealthMonitor`), the :class:`InterruptibleEngine` episodes generate
through, pausing and resuming generation, the weight hand-over (from disk, or
tensors one engine at a time or over one shared :class:`FleetWeightGroup`),
and the servers that join: each is brought to the current weights (the latest
on disk, or the latest tensors kept for it) before it takes traffic.

Everything here runs on the controller's event loop; the controller turns
these coroutines into its thread-safe methods. Admission follows the fleet
through :class:`Admission`: paused while the weights change, stamping
episodes with the version once the engines have loaded it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

from areal_core.api.inference import (GenerationRequest, GenerationResponse, InferenceEngine, SamplingParams,
                                      ServerTimeout)
from areal_core.clock import REAL_CLOCK, Clock
from areal_core.rollout.admission import Admission
from areal_core.rollout.elastic import (DOWN, JOINING, ElasticConfig, EngineLost, EnginePool, HealthMonitor, Member,
                                         NoEngineError, Topology, settle)
from areal_core.rollout.interruptible import ENGINE_FAILURES, InterruptibleEngine
from areal_core.rollout.weight_group import FleetWeightGroup, GroupMemberFailed
from areal_core.weight_check import (PROBE_NEW_TOKENS, PROBE_PROMPT_IDS, PROBE_RID_PREFIX, PROBE_SEED, SentDigests,
                                     WeightCheckError, compare_digests, not_checkable)
from areal_core.weight_delta import DeltaBaseMismatch, WeightDelta

log = logging.getLogger("areal.rollout")

# A server dropped for serving weights other than those sent is reloaded (elastic) at most this many times.
WEIGHT_CHECK_RELOADS = 1


class Fleet:
    def __init__(self, engines: list[InferenceEngine], admission: Admission, *, request_timeout_s: float,
                 elastic: ElasticConfig | None = None,
                 engine_factory: Callable[[str], InferenceEngine] | None = None,
                 on_topology_event: Callable[[str, str, str], None] | None = None,
                 launcher_discovery_file: str | None = None, clock: Clock = REAL_CLOCK,
                 check_holds: str = "generation") -> None:
        if check_holds not in ("generation", "training"):
            raise ValueError(f"check_holds={check_holds!r}: choose 'generation' or 'training' "
                             "(rollout.weight_check_holds)")
        self.initial_engines = list(engines)
        self.clock = clock
        self.admission = admission
        self.request_timeout_s = request_timeout_s
        self.elastic = elastic if elastic is None or elastic.enabled else None
        self.engine_factory = engine_factory  # address -> engine, for add_server() and discovery
        self.on_topology_event = on_topology_event  # (kind, server, why) when a server leaves or joins routing
        self.launcher_discovery_file = launcher_discovery_file  # servers the launcher restarted, one per line
        self.pool: EnginePool | None = None
        self.monitor: HealthMonitor | None = None
        self.engine: InterruptibleEngine | None = None
        self.weights_path: str | None = None  # the latest weights on disk: joining servers load them
        # ... or, elastic with weight_sync=tensors, the latest tensors themselves (copies the trainer handed over)
        self.weights_tensors: list | None = None
        self.started_engines: set[int] = set()  # ids of engines whose start() ran (discovered ones start late)
        self.weight_group: FleetWeightGroup | None = None  # one group over every routed server, when they share one
        # The integrity gate (areal_core.weight_check): the trainer's digests of the weights now served (joiners are
        # checked against them), servers reloaded after failing it, and the failures seen (for logs and tests).
        self.sent_digests: SentDigests | None = None
        self.weight_reloads: dict[str, int] = {}
        self.weight_failures: list[WeightCheckError] = []
        self.not_checkable_logged: dict[str, set[str]] = {}  # per server, the tensors it could not digest (logged)
        self.digest_s = 0.0  # the engines' share of the last check (the slowest engine's digest), seconds
        self.held = False  # generation stays paused after an update until release() (the parity probe is judged)
        self.probe_results: dict[str, GenerationResponse] = {}  # the last parity probe, per server
        self.delta_bytes = self.full_bytes = 0  # what the last tensors update sent, as deltas and as full weights
        # rollout.weight_check_holds: "training" checks the digests beside generation (only the hand-out waits for the
        # verdict; see check_beside), "generation" before it resumes. Probe updates and elastic fleets: always before.
        self.check_holds = check_holds
        self.defer_check = False  # this update's check runs beside generation (set per update by swap)
        self.checking: asyncio.Task | None = None  # the last update's check beside generation, while it runs
        self.check_failure: BaseException | None = None  # ... and how it failed: raised at the next update

    # ------------------------------------------------------------ lifecycle (on the loop)
    def open(self) -> None:
        """Build the pool and the routing engine, on the loop's thread."""
        self.pool = EnginePool(self.initial_engines, self.elastic, self.on_topology_event, now=self.clock.now)
        self.engine = InterruptibleEngine(self.pool, self.request_timeout_s)

    async def start(self) -> None:
        await asyncio.gather(*(e.start() for e in self.initial_engines))
        self.started_engines.update(id(e) for e in self.initial_engines)
        if self.elastic is not None:
            discover = self.engine_for if self.engine_factory is not None else None
            self.monitor = HealthMonitor(self.pool, self.bring_up, discover, self.launcher_discovery_file)
            self.monitor.start()

    async def stop_watching(self) -> None:
        """Stop the health monitor and drop the shared weight group (before the episodes' tasks end)."""
        if self.monitor is not None:
            await self.monitor.stop()
        if self.weight_group is not None:
            await self.weight_group.drop(self.pool.active())

    async def aclose(self) -> None:
        await asyncio.gather(*(m.engine.aclose() for m in self.pool.members), return_exceptions=True)

    # ------------------------------------------------------------ pause and weights
    async def pause(self) -> None:
        self.admission.set_paused(True)
        self.engine.close_gate()
        if all("pause" in e.capabilities for e in self.engines):
            await self._on_members(lambda e: e.pause(), "pause")
        else:  # no interruption: let requests in flight finish under the old weights
            await self.pool.idle.wait()

    async def resume(self) -> None:
        if all("pause" in e.capabilities for e in self.engines):
            await self._on_members(lambda e: e.resume(), "resume")
        self.admission.set_paused(False)
        self.engine.open_gate()
        self.admission.admit()

    async def _on_members(self, call: Callable[[InferenceEngine], Awaitable[Any]], what: str) -> None:
        """``call`` on every routed engine at once. Elastic: an engine that fails leaves routing
        (it would serve stale weights); otherwise the first failure is raised."""
        async def on(member: Member) -> Any:
            if self.elastic is None:
                return await self.within(member, call(member.engine), what)
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

    async def within(self, member: Member, call: Awaitable[Any], what: str) -> Any:
        """``await call`` on ``member``'s engine for at most ``request_timeout_s``; past it a TimeoutError naming
        the server and the phase (every phase of a weight update has one: a hung server never hangs the run)."""
        try:
            return await asyncio.wait_for(call, self.request_timeout_s)
        except asyncio.TimeoutError:
            describe = getattr(member.engine, "describe", None)  # e.g. "embedded engine 0 at 127.0.0.1:port"
            server = f"inference server {member.name}" + (f" ({describe()})" if callable(describe) else "")
            log = getattr(member.engine, "log_path", None)
            raise ServerTimeout(f"{server}: {what} did not finish: waited {self.request_timeout_s:g} s "
                                f"(rollout.request_timeout_s); the server is stopped, swapping, stuck or overloaded. "
                                f"Fix: see its log{f' ({log})' if log else ''}; if this phase can legitimately "
                                f"take longer, raise rollout.request_timeout_s") from None

    async def swap(self, apply: Callable[[], Awaitable[Any]], version: int, probe: bool = False) -> float:
        """Pause, run ``apply()``, serve ``version``, resume; nothing else inside the pause. The seconds paused.

        ``probe``: then sample the parity probe on every routed engine (:meth:`probe_engines`) and keep
        generation paused (``held``) until :meth:`release`, once the trainer has judged the probe."""
        await self.settle_check()  # the last update's check beside generation has ended (and passed)
        began = self.clock.now()
        async with self.pool.lock:  # never beside a rebuild of the server set
            self.defer_check = self.check_holds == "training" and self.elastic is None and not probe
            await self.pause()
            hold = False
            try:
                await apply()
                self.admission.serve(version)
                if probe:
                    self.probe_results = await self.probe_engines(version)
                    hold = True
            finally:
                if hold:
                    self.held = True
                else:
                    await self.resume()
        return self.clock.now() - began

    async def probe_engines(self, version: int) -> dict[str, GenerationResponse]:
        """The parity probe (:mod:`areal_core.weight_check`) on every routed engine, straight to each engine (no
        routing: generation is still paused for everything else). Engines that pause are resumed first."""
        if all("pause" in e.capabilities for e in self.engines):
            await self._on_members(lambda e: e.resume(), "resume")
        request = GenerationRequest(list(PROBE_PROMPT_IDS), SamplingParams(
            max_new_tokens=PROBE_NEW_TOKENS, temperature=1.0, seed=PROBE_SEED), rid=f"{PROBE_RID_PREFIX}{version}")
        answers = await self._ask_each(self.pool.active(), lambda e: e.agenerate(request),
                                       f"the parity probe of version {version}")
        return {member.name: answer for member, answer in answers}

    async def _ask_each(self, members: list[Member], call: Callable[[InferenceEngine], Awaitable[Any]],
                        what: str) -> list[tuple[Member, Any]]:
        """``call`` on each of ``members`` at once, each within its timeout (:meth:`within`); (member, answer) of
        those that answered. One that failed: raised, or (elastic) it leaves routing."""
        results = await asyncio.gather(*(self.within(m, call(m.engine), what) for m in members),
                                       return_exceptions=True)
        answered = []
        for member, result in zip(members, results):
            if isinstance(result, BaseException):
                if self.elastic is None or not isinstance(result, (*ENGINE_FAILURES, TimeoutError)):
                    raise result
                self.pool.remove(member, f"{what} failed: {type(result).__name__}: {result}")
                continue
            answered.append((member, result))
        return answered

    async def release(self, failed: dict[str, WeightCheckError]) -> None:
        """End a held update: servers whose probe ``failed`` leave routing (elastic: they are reloaded; otherwise
        the first failure is raised, generation staying paused), then generation resumes for the others."""
        for member in [m for m in self.pool.active() if m.name in failed]:
            self._failed_check(member, failed[member.name])
        self.held = False
        self.admission.set_paused(False)
        self.engine.open_gate()
        self.admission.admit()

    async def load_from_disk(self, path: str, version: int, sent: SentDigests | Future | None = None) -> None:
        await self._on_members(lambda e: e.update_weights_from_disk(path, version), "update_weights_from_disk")
        self.weights_path, self.weights_tensors = str(path), None
        await self._judge(sent, version)

    async def _sent(self, sent: SentDigests | Future | None, version: int) -> SentDigests | None:
        """The trainer's digests of ``version``: as given, or, given as a ``concurrent.futures.Future`` (the
        trainer digests on a thread of its own while the engines load), once it is done; waited for at most
        ``request_timeout_s``."""
        if not isinstance(sent, Future):
            return sent
        try:
            return await asyncio.wait_for(asyncio.wrap_future(sent), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the trainer's digests of the weights of version {version} did not come: waited "
                               f"{self.request_timeout_s:g} s (rollout.request_timeout_s)") from None

    async def load_tensors(self, named_tensors: list, version: int, sent: SentDigests | Future | None = None,
                           delta: WeightDelta | None = None) -> None:
        """Every routed engine takes the tensors of ``version``: over the shared group when there is one; else
        one engine at a time, as ``delta`` (the change from ``delta.base_version``) to each engine that holds
        that version and takes deltas, the full tensors to the others."""
        group = self._shared_weight_group()
        if group is None:
            self.delta_bytes = self.full_bytes = 0
            full = sum(t.numel() * t.element_size() for _, t in named_tensors if hasattr(t, "numel"))

            async def update(engine: InferenceEngine) -> None:
                if delta is not None and "update_weights_from_delta" in engine.capabilities \
                        and engine.version == delta.base_version:
                    try:
                        await engine.update_weights_from_delta(delta, version)
                        self.delta_bytes += delta.nbytes
                        return
                    except DeltaBaseMismatch as refused:  # it moved meanwhile: the full weights follow
                        log.info("inference server %s refused the delta (%s); sending the full weights",
                                 getattr(engine, "address", type(engine).__name__), refused)
                await engine.update_weights_from_tensors(named_tensors, version)
                self.full_bytes += full

            await self._on_members(update, "update_weights_from_tensors")
        else:
            await self._update_over_group(group, named_tensors, version)
        self.weights_path = None  # the weights now loaded are on no disk
        # A joiner (a restarted server) takes these; kept only when servers may join (one model's copy)
        self.weights_tensors = list(named_tensors) if self.elastic is not None else None
        await self._judge(sent, version)

    # ------------------------------------------------------------ the integrity gate
    async def _judge(self, sent: SentDigests | Future | None, version: int) -> None:
        """The integrity gate on the update to ``version`` just loaded: :meth:`check_weights` now (generation
        still paused), or, when this update's check runs beside generation (``defer_check``), begun as a task
        (:meth:`check_beside`) with the hand-out held until it ends."""
        if not self.defer_check or sent is None:
            await self.check_weights(await self._sent(sent, version))
            return
        self.admission.hold_hand_out(version)
        self.checking = asyncio.ensure_future(self.check_beside(sent, version))

    async def check_beside(self, sent: SentDigests | Future, version: int) -> None:
        """``rollout.weight_check_holds: training``: the check of ``version`` while generation goes on. The trainer
        is handed no batch holding a token of ``version`` until it has ended; a failure (a server that differs
        leaves routing at once, a digest that never came) is raised by every hand-out from then on and by the
        next update, so no sample generated since the update is trained on and the run stops naming the server
        and the tensors. Never raises itself."""
        failure: BaseException | None = None
        try:
            await self.check_weights(await self._sent(sent, version))
        except asyncio.CancelledError:  # the controller is closing: nothing unchecked may be handed out after
            failure = RuntimeError(f"the check of the weights of version {version} was cancelled")
            raise
        except Exception as exc:
            failure = self.check_failure = exc
            log.error("weight check of version %d (beside generation) failed: %s", version, exc)
        finally:
            self.admission.checked(version, failure)

    async def settle_check(self) -> None:
        """Wait for the last update's check beside generation to end; raise how it failed, if it did."""
        task = self.checking
        if task is not None:
            await asyncio.shield(task)  # an awaiter cancelled must not cancel the check itself
            if self.checking is task:
                self.checking = None
        if self.check_failure is not None:
            raise self.check_failure

    async def check_weights(self, sent: SentDigests | None) -> None:
        """Every routed engine that declares ``weight_digest`` reports the digests of what it now holds; one
        that differs from ``sent`` (the trainer's) leaves routing before generation resumes: the run stops
        naming it and the tensors that differ, or (elastic) it is reloaded with the current weights."""
        self.sent_digests = sent
        if sent is None:
            return
        members = [m for m in self.pool.active() if "weight_digest" in m.engine.capabilities]
        began = self.clock.now()
        held = await self._ask_each(members, lambda e: e.weight_digest(sent.mode),
                                    f"the weight digest of version {sent.version}")
        self.digest_s = self.clock.now() - began
        for member, result in held:
            self._log_not_checkable(member.name, sent, result)
            differences = compare_digests(sent.digests, result)
            if differences:
                self._failed_check(member, WeightCheckError(member.name, sent.version, f"the digests of "
                                                            f"{len(differences)} of {len(sent.digests)} tensors "
                                                            "differ", differences))

    def _log_not_checkable(self, server: str, sent: SentDigests, held: dict[str, str]) -> None:
        """Say (once per server and set of tensors) which tensors sent ``server`` cannot digest, and why."""
        skipped = not_checkable(sent.digests, held)
        if skipped and self.not_checkable_logged.get(server) != set(skipped):
            self.not_checkable_logged[server] = set(skipped)
            log.warning("weight check: inference server %s cannot digest %d of the %d tensors sent (not checked; the "
                        "parity probe still covers them): %s", server, len(skipped), len(sent.digests),
                        "; ".join(f"{name} ({why})" for name, why in sorted(skipped.items())))

    def _failed_check(self, member: Member, error: WeightCheckError) -> None:
        """``member`` serves other weights than those sent: out of routing now; elastic, reloaded once (a fresh
        client for its address joins at the next rebuild, checked again); otherwise ``error`` is raised."""
        self.weight_failures.append(error)
        self.pool.remove(member, str(error))
        if self.elastic is None:
            raise error
        address = getattr(member.engine, "address", None)
        if self.engine_factory is None or not address or self.weight_reloads.get(address, 0) >= WEIGHT_CHECK_RELOADS:
            return
        self.weight_reloads[address] = self.weight_reloads.get(address, 0) + 1
        self.pool.add(self.engine_factory(address))

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

    # ------------------------------------------------------------ topology
    @property
    def engines(self) -> list[InferenceEngine]:
        """The engines now routed to (before start: the ones given)."""
        return self.initial_engines if self.pool is None else [m.engine for m in self.pool.active()]

    @property
    def topology(self) -> Topology:
        if self.pool is None:
            raise RuntimeError("the rollout controller is not started; call start() first")
        return self.pool.topology

    def members(self) -> list[Member]:
        return list(self.pool.members) if self.pool is not None else []

    def engine_for(self, address: str) -> InferenceEngine:
        if self.engine_factory is None:
            raise ValueError(f"cannot add the inference server at {address}: the controller was built without an "
                             "engine_factory (address -> engine); pass the engine itself to add_engine()")
        return self.engine_factory(address)

    async def bring_up(self, engine: InferenceEngine) -> None:
        """Start a joining engine (a discovered one was only built) and bring it to the current weights, from
        disk or from the latest tensors, before it takes traffic."""
        if id(engine) not in self.started_engines:
            await engine.start()
            self.started_engines.add(id(engine))
        version = self.admission.version
        if engine.version == version:
            return
        if self.weights_path is not None:
            await engine.update_weights_from_disk(self.weights_path, version)
        elif self.weights_tensors is not None and "update_weights_from_tensors" in engine.capabilities:
            await engine.update_weights_from_tensors(self.weights_tensors, version)
        else:
            raise RuntimeError(f"a server joining at version {version} (it has {engine.version}) needs the "
                               "current weights, but they are on no disk and no tensors of them are kept (no "
                               "update yet, or the engine does not take tensors); use rollout.weight_sync=disk")
        sent = self.sent_digests
        if sent is not None and sent.version == version and "weight_digest" in engine.capabilities:
            differences = compare_digests(sent.digests, await engine.weight_digest(sent.mode))
            if differences:  # the joiner is refused (it never takes traffic)
                name = getattr(engine, "address", None) or type(engine).__name__
                error = WeightCheckError(name, version, f"joining: the digests of {len(differences)} of "
                                         f"{len(sent.digests)} tensors differ", differences)
                self.weight_failures.append(error)
                raise error

    async def join(self, engine: InferenceEngine, timeout_s: float) -> Topology:
        """Start ``engine``, bring it to the current weights at the next rebuild (after the cooldown), route to
        it; the topology it joined."""
        await engine.start()
        self.started_engines.add(id(engine))
        member = self.pool.add(engine)
        deadline = self.clock.now() + timeout_s
        while member.state == JOINING:
            if self.pool.cooldown_left() == 0 and not self.pool.lock.locked():
                async with self.pool.lock:
                    if member.state == JOINING:
                        await self.pool.rebuild(self.bring_up)
                continue
            if self.clock.now() >= deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for inference server {member.name} to join "
                                   f"(cooldown left {self.pool.cooldown_left():.0f} s)")
            await asyncio.sleep(min(0.2, max(0.01, self.pool.cooldown_left())))
        if member.state == DOWN:
            raise RuntimeError(f"inference server {member.name} could not join; see the log above")
        self.admission.kick()
        return self.pool.topology
