"""Admission and hand-out: which items start as episodes, and which finished groups form each batch.

This part owns the training episodes' state: the queued items and the data
source, the running episodes, the ready groups, the done items (what resume
skips), the versions, and the :class:`StalenessManager` that decides both
halves of the staleness bound. It runs no thread of its own: :meth:`Admission.admit`
and the episodes run on the controller's event loop, the hand-out
(:meth:`Admission.wait`, :meth:`Admission.prepare_batch`) on the trainer's
thread, all under one condition.

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
first: the weight update records its target at once (:meth:`Admission.aim`),
and ``prepare_batch`` takes the trainer's version explicitly, so the hand-out
never decides with a version that lags.
With ``eta = 0`` the controller is an ordinary synchronous trainer: batch
``k`` is exactly the ``k``-th block of ``batch_size`` items.
"""

from __future__ import annotations

import asyncio
import heapq
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Iterator

from areal_core.api.inference import InferenceEngine
from areal_core.api.workflow import Workflow
from areal_core.clock import REAL_CLOCK, Clock
from areal_core.rollout.batch import EpisodeGroup
from areal_core.rollout.staleness import StalenessManager

ShouldAccept = Callable[[EpisodeGroup], bool]


class RolloutError(RuntimeError):
    """A workflow raised; the message names the workflow and the item."""


class StallError(RuntimeError):
    """The data source ran dry before a batch could be filled."""


class Admission:
    """The training episodes, from item to handed-out group.

    ``kick`` schedules :meth:`admit` on the event loop from any thread; ``engine`` (set when the loop starts)
    is what the episodes generate with.
    """

    def __init__(self, workflow: Workflow, staleness: StalenessManager, should_accept: ShouldAccept | None,
                 kick: Callable[[], None], clock: Clock = REAL_CLOCK) -> None:
        self.workflow = workflow
        self.staleness = staleness
        self.batch_size = staleness.batch_size
        self.should_accept = should_accept
        self.kick = kick
        self.engine: InferenceEngine | None = None
        self.cond = clock.condition()
        self._now = clock.now  # episode timestamps; the hand-out's own timeout stays wall-clock
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
        self._stopped = False  # stop(): no more training episodes
        # Versions whose weight check (rollout.weight_check_holds: training) runs beside generation: no group with
        # a token of one is handed out until it has passed (a failed one becomes _error, raised by every hand-out)
        self._unchecked: set[int] = set()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------ versions and switches
    @property
    def version(self) -> int:
        return self._version

    def aim(self, version: int) -> None:
        """A weight update to ``version`` has begun: batches taken meanwhile are trained at it."""
        with self.cond:
            self._target_version = max(self._target_version, version)

    def serve(self, version: int) -> None:
        """The engines now serve ``version``: new episodes are stamped with it."""
        with self.cond:
            self._version = version
            self.cond.notify_all()

    def set_version(self, version: int) -> None:
        with self.cond:
            self._version = self._target_version = version
            self.cond.notify_all()
        self.kick()

    def hold_hand_out(self, version: int) -> None:
        """The engines' weights of ``version`` are being checked beside generation: no group holding a token
        sampled under it is handed out until :meth:`checked` (no sample of unchecked weights reaches the
        trainer); groups generated before the update still go."""
        with self.cond:
            self._unchecked.add(version)

    def checked(self, version: int, failure: BaseException | None = None) -> None:
        """The check of ``version`` has ended; ``failure``: it failed, and every hand-out from now on raises it
        (the run stops: whatever was generated since the update is never trained on)."""
        with self.cond:
            self._unchecked.discard(version)
            if failure is not None and self._error is None:
                self._error = failure
            self.cond.notify_all()

    def set_paused(self, paused: bool) -> None:
        with self.cond:
            self._paused = paused

    def stop(self) -> None:
        """Admit no more training episodes."""
        with self.cond:
            self._stopped = True

    async def cancel(self) -> int:
        """Cancel the running episodes (on the loop); returns how many."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    # ------------------------------------------------------------ input
    def _require_restored_weights(self) -> None:
        if self._version < self._restored_version:
            raise RuntimeError(
                f"the rollout controller was restored at version {self._restored_version} but the engines serve "
                f"version {self._version}: hand them the restored weights (update_weights_from_disk / "
                f"update_weights_from_tensors with version {self._restored_version}) before submitting items")

    def submit(self, item: Any) -> None:
        self._require_restored_weights()
        with self.cond:
            self._pending.append((self._next_seq, item))
            self._next_seq += 1
        self.kick()

    def set_source(self, source: Iterable[Any]) -> None:
        self._require_restored_weights()
        with self.cond:
            self._source_obj = source
            self._source = iter(source)
            self._source_done = False
        self.kick()

    def _next_item(self) -> tuple[int, Any] | None:
        if self._pending:
            return self._pending.popleft()
        while self._source is not None and not self._source_done:
            try:
                item = next(self._source)
            except StopIteration:
                self._source_done = True
                self.cond.notify_all()
                return None
            seq = self._next_seq
            self._next_seq += 1
            if seq >= self._resumed_watermark and seq not in self._resumed_extra:
                return seq, item
        return None

    # ------------------------------------------------------------ the loop side
    def admit(self) -> None:
        """Start episodes while the staleness bound and the concurrency limit allow (on the loop)."""
        with self.cond:
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
        admitted = self._now()
        try:
            result = await self.workflow.arun_episode(self.engine, item)
            group = None
            if result is not None:
                group = EpisodeGroup(seq, item, start_version, list(result), admitted, self._now())
                self._generated_tokens += group.generated_tokens()
                if self.should_accept is not None and not self.should_accept(group):
                    group = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            with self.cond:
                if self._error is None:
                    err = RolloutError(f"workflow {type(self.workflow).__name__} failed on item #{seq} "
                                       f"({_short(item)}): {type(exc).__name__}: {exc}")
                    err.__cause__ = exc
                    self._error = err
                self.cond.notify_all()
            return
        with self.cond:
            del self._running[seq]
            if group is None:
                self.staleness.on_reject()
                self._mark_done(seq)
            else:
                self.staleness.on_accept()
                heapq.heappush(self._ready, (start_version, seq, group))
            self.cond.notify_all()
        self.admit()

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

    def _holds_unchecked(self, count: int) -> bool:
        """Whether the ``count`` oldest ready groups (the next batch) hold a token sampled under a version whose
        weight check is still running (:meth:`hold_hand_out`): that batch waits for the verdict; one generated
        before the update does not."""
        if not self._unchecked:
            return False
        return any(v in self._unchecked for _, _, group in heapq.nsmallest(count, self._ready)
                   for trajectory in group.trajectories for v in trajectory.versions)

    def _stalled(self, count: int) -> bool:
        return (self._source_done or self._source is None) and not self._pending and not self._running \
            and len(self._ready) < count and not self._unchecked

    def wait(self, count: int, timeout: float | None = None, version: int | None = None) -> list[EpisodeGroup]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                if self._error is not None:
                    raise self._error
                if not self._holds_unchecked(count) and self._can_hand_out(count, self._train_version(version)):
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
                self.cond.wait(remaining if remaining is not None else 1.0)

    def prepare_batch(self, dataloader: Iterable[Any], timeout: float | None = None,
                      version: int | None = None) -> list[EpisodeGroup]:
        if dataloader is not self._source_obj:
            self.set_source(dataloader)
        with self.cond:
            # (a wait for a weight check beside generation is no wait for rollouts: pacing does not count it)
            ready, waited = len(self._ready), not self._can_hand_out(self.batch_size, self._train_version(version))
            first = self._consumed_accepted == 0  # nothing could have been generated ahead of it
        groups = self.wait(self.batch_size, timeout, version)
        with self.cond:
            grew = self.staleness.on_hand_out(waited and not first, ready)
        if grew:
            self.kick()
        return groups

    def _describe(self) -> str:
        c = self.staleness.counts
        checking = (f", the weights of version(s) {sorted(self._unchecked)} still being checked"
                    if self._unchecked else "")
        return (f"{len(self._ready)} ready, {len(self._running)} running, {len(self._pending)} queued, "
                f"{c.rejected} rejected, version {self._version}, paused={self._paused}, "
                f"admission capacity {self.staleness.capacity(self._version)}{checking}")

    # ------------------------------------------------------------ state
    def stats(self, servers: int) -> dict[str, int]:
        with self.cond:
            c = self.staleness.counts
            return {"version": self._version, "queued": len(self._pending), "running": len(self._running),
                    "servers": servers,
                    "ready": len(self._ready), "started": c.started, "accepted": c.accepted,
                    "rejected": c.rejected, "consumed": self._consumed_accepted, "lead": self.staleness.lead,
                    "generated_tokens": self._generated_tokens}

    def state_dict(self) -> dict:
        with self.cond:
            return {"version": self._version, "consumed": self._consumed_accepted,
                    "rejected": self.staleness.counts.rejected,
                    "done_watermark": self._done_watermark, "done_extra": sorted(self._done_extra)}

    def load_state_dict(self, state: dict) -> None:
        with self.cond:
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
