"""The rollout controller: many episodes in flight on one asyncio loop,
admitted under the staleness bound, handed to the trainer as batches.

The trainer is ordinary synchronous code; the controller runs its event loop
in a background thread and the trainer calls the thread-safe methods here
(``submit``, ``wait``, ``prepare_batch``, ``pause``, ``resume``,
``update_weights``). Workflows run as asyncio tasks on that loop; sync
rewards they call through :func:`areal_core.api.call_reward` run in the
loop's default executor, a thread pool, never on the loop itself.

The controller owns the loop thread and puts together the parts that each own
one thing:

- :mod:`areal_core.rollout.admission`: which items start and which finished
  groups form each batch (the staleness rule, through
  :class:`~areal_core.rollout.staleness.StalenessManager`), the versions, and
  what resume needs;
- :mod:`areal_core.rollout.fleet`: the engines, pausing them, handing them
  new weights, and servers joining and leaving;
- :mod:`areal_core.rollout.evaluation`: evaluation episodes beside training.

A call that runs on the loop and is collected later is a
:class:`~areal_core.pending.PendingCall`.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Iterable

from areal_core.api.inference import InferenceEngine
from areal_core.api.workflow import Workflow
from areal_core.clock import REAL_CLOCK, Clock
from areal_core.pending import PendingCall
from areal_core.rollout.admission import Admission, RolloutError, ShouldAccept, StallError
from areal_core.rollout.batch import EpisodeGroup
from areal_core.rollout.elastic import ElasticConfig, Member, Topology
from areal_core.rollout.evaluation import run_evaluation
from areal_core.rollout.fleet import Fleet
from areal_core.rollout.staleness import StalenessManager
from areal_core.threads import serial_torch
from areal_core.weight_check import SentDigests
from areal_core.weight_delta import WeightDelta

__all__ = ["PendingCall", "RolloutController", "RolloutError", "ShouldAccept", "StallError", "has_reward_variance"]


def has_reward_variance(group: EpisodeGroup) -> bool:
    """A ``should_accept`` for dynamic filtering: False when every reward in the
    group is the same, which gives no signal under a group baseline."""
    return len(set(group.rewards)) > 1


def _of_fleet(name: str, doc: str | None = None) -> property:
    return property(lambda self: getattr(self.fleet, name), doc=doc)


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
        clock: Clock = REAL_CLOCK,
        weight_check_holds: str = "generation",
    ) -> None:
        self.clock = clock  # the loop, the episodes' times and the trainer's waits on the loop (areal_core.clock)
        self.batch_size = batch_size
        self.eta = max_head_offpolicyness
        self.staleness = StalenessManager(batch_size, max_head_offpolicyness, max_concurrent_rollouts, pacing)
        self.admission = Admission(workflow, self.staleness, should_accept, self._kick, clock)
        self.fleet = Fleet(engines, self.admission, request_timeout_s=request_timeout_s, elastic=elastic,
                           engine_factory=engine_factory, on_topology_event=on_topology_event,
                           launcher_discovery_file=launcher_discovery_file, clock=clock,
                           check_holds=weight_check_holds)
        self.workflow = workflow
        self.should_accept = should_accept
        self.request_timeout_s = request_timeout_s
        self.call_timeout_s = call_timeout_s
        self._reward_workers = reward_workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # What the fleet owns, under the names the controller has always had (read-only).
    elastic = _of_fleet("elastic")
    pool = _of_fleet("pool")
    monitor = _of_fleet("monitor")
    engine = _of_fleet("engine", "The InterruptibleEngine every episode generates through (once started).")
    weight_group = _of_fleet("weight_group", "One group over every routed server, when they share one.")

    # ------------------------------------------------------------ lifecycle
    def start(self) -> RolloutController:
        if self._thread is not None:
            return self
        ready = threading.Event()

        def run() -> None:
            # Torch work here (weight staging, collectives) must not form a second OpenMP team beside the
            # training thread's: see areal_core.threads.
            serial_torch()
            loop = self.clock.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.set_default_executor(ThreadPoolExecutor(self._reward_workers, thread_name_prefix="areal-reward",
                                                         initializer=serial_torch))
            self._loop = loop
            self.fleet.open()
            self.admission.engine = self.fleet.engine
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        self._thread = threading.Thread(target=run, name="areal-rollout", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise TimeoutError("waited 30 s for the rollout controller's event loop thread to start")
        self._call(self.fleet.start(), f"start {len(self.fleet.initial_engines)} inference engine(s)")
        return self

    def close(self) -> None:
        """Cancel every episode and stop the loop thread; idempotent."""
        if self._loop is None or self._thread is None:
            return
        loop, self._loop = self._loop, None

        async def shutdown() -> None:
            await self.admission.cancel()
            await self.fleet.stop_watching()
            # what is left (evaluation episodes, their engine calls) ends before the loop does
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self.fleet.aclose()

        try:
            self.clock.wait_future(asyncio.run_coroutine_threadsafe(shutdown(), loop), self.call_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"waited {self.call_timeout_s:.0f} s for episodes to cancel and "
                               "inference engines to close") from None
        finally:
            loop.call_soon_threadsafe(loop.stop)
            with self.clock.blocked():  # the loop must run to stop: a virtual clock's lockstep lets it
                self._thread.join(self.call_timeout_s)
            self._thread = None

    def __enter__(self) -> RolloutController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Awaitable[Any], what: str) -> Any:
        return self._begin(coro, what).result()

    def _begin(self, coro: Awaitable[Any], what: str) -> PendingCall:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the rollout controller is not started; call start() first")
        return PendingCall(asyncio.run_coroutine_threadsafe(coro, self._loop), self.call_timeout_s,
                           f"the rollout controller to {what}", self.clock)

    def _kick(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.admission.admit)

    # ------------------------------------------------------------ input and output
    @property
    def version(self) -> int:
        return self.admission.version

    def submit(self, item: Any) -> None:
        """Queue one item (one prompt group); it starts when admission allows."""
        self.admission.submit(item)

    def set_source(self, source: Iterable[Any]) -> None:
        """Pull items from ``source`` whenever admission allows (used by ``prepare_batch``)."""
        self.admission.set_source(source)

    def wait(self, count: int, timeout: float | None = None, version: int | None = None) -> list[EpisodeGroup]:
        """Block until ``count`` accepted groups can be handed out; oldest first.

        ``version``: the policy version the groups will be trained at (default: the newest version the
        engines serve or are loading, see :meth:`update_weights`)."""
        return self.admission.wait(count, timeout, version)

    def prepare_batch(self, dataloader: Iterable[Any], timeout: float | None = None,
                      version: int | None = None) -> list[EpisodeGroup]:
        """The next batch of ``batch_size`` groups, drawing items from ``dataloader`` as admission allows.

        Keep passing the same dataloader: it is iterated once, lazily, across calls. ``version``: the
        policy version the batch will be trained at (the trainer passes its own; see :meth:`wait`).
        """
        return self.admission.prepare_batch(dataloader, timeout, version)

    # ------------------------------------------------------------ weights
    def set_version(self, version: int) -> None:
        """Declare the version the engines serve now (no update runs: the caller vouches for it)."""
        self.admission.set_version(version)

    def pause(self) -> None:
        """Stop admitting; engines abort in-flight requests, which wait to be continued."""
        self._call(self.fleet.pause(), "pause generation")

    def resume(self) -> None:
        self._call(self.fleet.resume(), "resume generation")

    def update_weights(self, apply: Callable[[], Awaitable[Any]], version: int,
                       wait: bool = True, probe: bool = False) -> "float | PendingCall":
        """Pause, run ``apply()`` on the loop, set ``version``, resume; nothing else inside the pause.

        Returns the seconds generation was paused; with ``wait=False`` at once,
        a :class:`PendingCall` whose ``result()`` gives them. Episodes are
        stamped with the version the engines serve, which moves only once they
        have loaded; a batch taken meanwhile is decided by ``version`` (recorded
        here before the call returns), so a caller going on while the servers
        load (the trainer at eta > 0) never gets a sample staler than the bound.

        ``probe``: after the load, every routed engine samples the parity probe
        (:mod:`areal_core.weight_check`; the answers in :attr:`probe_results`) and
        generation stays paused until :meth:`release`.

        The digests' check (``sent`` of the ``update_weights_from_*`` calls) runs
        before generation resumes, or, built with ``weight_check_holds="training"``
        (and neither ``probe`` nor elastic), beside it: the update returns once the
        engines serve the new version, and :meth:`wait` / :meth:`prepare_batch`
        hand nothing out until the check has passed; a failure is raised by them
        and by the next update.
        """
        self.admission.aim(version)
        what = f"update weights to version {version}"
        swap = self.fleet.swap(apply, version, probe)
        return self._call(swap, what) if wait else self._begin(swap, what)

    def update_weights_from_disk(self, path: str, version: int, wait: bool = True,
                                 sent: SentDigests | Future | None = None,
                                 probe: bool = False) -> "float | PendingCall":
        """Every routed engine loads the safetensors folder ``path``; see :meth:`update_weights`. ``sent``: the
        trainer's digests of the folder, which every engine declaring ``weight_digest`` must match before it
        takes traffic again (:meth:`Fleet.check_weights <areal_core.rollout.fleet.Fleet.check_weights>`); or a
        ``concurrent.futures.Future`` of them, still being computed while the engines load, waited for at most
        ``request_timeout_s`` before the comparison."""
        return self.update_weights(lambda: self.fleet.load_from_disk(path, version, sent), version, wait, probe)

    def settle_weight_check(self) -> None:
        """Wait until the last update's digest check beside generation (``weight_check_holds="training"``) has
        ended; raise its failure (a :class:`~areal_core.weight_check.WeightCheckError` naming the server and the
        tensors). Returns at once when none runs."""
        self._call(self.fleet.settle_check(), "finish the check of the weights the engines serve")

    @property
    def probe_results(self) -> dict:
        """The parity probe of the last update that asked for it: per server name, its GenerationResponse."""
        return dict(self.fleet.probe_results)

    def release(self, failed: dict | None = None) -> None:
        """Resume generation after an update held for the parity probe; the servers in ``failed`` (name ->
        :class:`~areal_core.weight_check.WeightCheckError`) leave routing first (elastic: and are reloaded;
        otherwise the first error is raised and generation stays paused)."""
        self._call(self.fleet.release(dict(failed or {})), "resume generation after the parity probe")

    def update_weights_from_tensors(self, named_tensors: list, version: int, wait: bool = True,
                                    sent: SentDigests | Future | None = None, probe: bool = False,
                                    delta: WeightDelta | None = None) -> "float | PendingCall":
        """Hand ``named_tensors`` ((name, tensor) pairs, full weights) to every routed engine; see
        :meth:`update_weights` (with ``wait=False`` the tensors must stay unchanged until the call is done).

        Engines whose class offers ``fleet_weight_group(engines)`` (every routed one) share ONE weight-update
        group, rebuilt at each topology version (:mod:`areal_core.rollout.weight_group`): each bucket is
        broadcast once for all. Others take the tensors one engine at a time. Elastic: an engine that fails
        leaves routing, as with disk updates; over a shared group the update then starts again over the
        group of the servers left, never waiting for the one that failed. ``sent``: the trainer's digests of
        the tensors, checked as with disk updates. ``delta``: the change from ``delta.base_version``
        (:mod:`areal_core.weight_delta`), sent instead to each engine that holds that version and declares
        ``update_weights_from_delta``.
        """
        return self.update_weights(lambda: self.fleet.load_tensors(named_tensors, version, sent, delta), version,
                                   wait, probe)

    # ------------------------------------------------------------ elastic topology
    @property
    def engines(self) -> list[InferenceEngine]:
        """The engines now routed to (before start: the ones given)."""
        return self.fleet.engines

    @property
    def topology(self) -> Topology:
        """The routed servers and the topology version: the weight-update group's size is ``topology.size``."""
        return self.fleet.topology

    def add_engine(self, engine: InferenceEngine, timeout_s: float | None = None) -> Topology:
        """Add a live server: start its client, bring it to the current weights at the next rebuild
        (after the cooldown), then route to it. Returns the topology it joined; raises if it could not."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        return self._call(self.fleet.join(engine, timeout_s),
                          f"add inference server {getattr(engine, 'address', type(engine).__name__)}")

    def add_server(self, address: str, timeout_s: float | None = None) -> Topology:
        """Add the server at ``address`` (host:port) through ``engine_factory``; see :meth:`add_engine`."""
        return self.add_engine(self.fleet.engine_for(address), timeout_s)

    def members(self) -> list[Member]:
        """Every server the controller has routed to, with its state and counters (for logs and tests)."""
        return self.fleet.members()

    # ------------------------------------------------------------ state
    def stop_rollouts(self) -> int:
        """Admit no more training episodes and cancel the running ones (the run is over); returns how many.

        Cancelled episodes count as not done, so a checkpoint taken afterwards
        still has them redone on resume. Evaluation keeps working.
        """
        self.admission.stop()
        return self._call(self.admission.cancel(), "cancel the running training episodes")

    def evaluate(self, workflow: Workflow, items: list[Any], concurrency: int = 32, timeout_s: float = 3600.0,
                 waited_for: str = "") -> PendingCall:
        """Run ``workflow`` on ``items`` beside the training rollouts. ``result()`` gives each item's result
        (:mod:`areal_core.rollout.evaluation`): its trajectories, None when the workflow rejected it, or the
        exception it raised; it waits at most ``timeout_s`` and then says it waited for ``waited_for``
        (default: "the evaluation of N items")."""
        if self._loop is None:
            raise RuntimeError("the rollout controller is not started; call start() first")
        async def checked_then_run() -> Any:
            await self.fleet.settle_check()  # no evaluation of weights whose check beside generation is running
            return await run_evaluation(workflow, self.engine, items, concurrency)

        future = asyncio.run_coroutine_threadsafe(checked_then_run(), self._loop)
        return PendingCall(future, timeout_s, waited_for or f"the evaluation of {len(items)} items", self.clock)

    def stats(self) -> dict[str, int]:
        return self.admission.stats(servers=len(self.fleet.engines))

    def state_dict(self) -> dict:
        """What resume needs: the version, the staleness counters as if nothing were in
        flight (in-flight episodes are redone after resume), and which items are done."""
        return self.admission.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters and done items of :meth:`state_dict`, before anything is submitted.

        The version the engines serve is not restored: they serve what they loaded (at a restart, the base
        model). Hand them the restored weights (``update_weights_from_*`` with the saved version) before any
        item is submitted; until then :meth:`submit` and :meth:`prepare_batch` refuse, so no episode is
        stamped with a version its tokens do not come from."""
        self.admission.load_state_dict(state)
