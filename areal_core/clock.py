"""Where the rollout controller and the trainer get their time: the real clock, or a virtual one.

Everything that measures or waits on time in the controller (its event loop,
the episodes' timestamps, the weight-update timings, the trainer's waits for
the loop) asks a :class:`Clock`. A real run uses :data:`REAL_CLOCK`:
``time.monotonic``, a plain asyncio loop, ``threading.Condition``. The
simulator (``areal-plugin-sim``) passes a :class:`VirtualClock`, under which
the very same code runs in simulated time: while nothing is runnable, time
jumps to the next timer, so an hour of modelled generation and training costs
the wall time of the Python that runs, not an hour.

**What "nothing is runnable" means.** The loop has no ready callbacks and
every thread that takes part (the trainer's, reward workers) is blocked in a
wait the clock knows of: :meth:`Clock.wait_future` (a call on the loop, a
modelled sleep), :meth:`Clock.condition`'s ``wait``, or the loop's executor.
Whoever wakes a blocked thread counts it as runnable *when it wakes it* (a
future's done-callback, a condition's ``notify``), before the loop goes on:
otherwise the loop could jump ahead in the instant between the wake-up and the
thread running again. Why by hand: asyncio's loops read ``time.monotonic`` and
no library we found (``looptime``, ``asynctest``'s ``ClockedTestCase``)
coordinates a virtual loop with threads that are not on it, which is how the
trainer and the controller meet.

Timeouts that guard against a hang (how long the trainer waits for a batch)
stay on the wall clock in both: they are about the program, not the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
import threading
import time
from typing import Any, Callable


class Clock:
    """The real clock: what every run uses unless a simulator passes another."""

    virtual = False

    def now(self) -> float:
        """Seconds on this clock (monotonic; only differences mean anything)."""
        return time.monotonic()

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.new_event_loop()

    def condition(self) -> threading.Condition:
        return threading.Condition()

    def wait_future(self, future: concurrent.futures.Future, timeout: float | None) -> Any:
        """``future.result(timeout)``, the wait counted as blocked on a virtual clock."""
        return future.result(timeout)

    def sleep(self, seconds: float) -> None:
        """Spend ``seconds`` on this clock from a thread off the loop (a modelled computation)."""
        time.sleep(seconds)


REAL_CLOCK = Clock()


class _Token:
    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken = False


class VirtualClock(Clock):
    """Simulated seconds, shared by one event loop (:meth:`new_event_loop`) and the threads that wait on it.

    ``threads``: how many threads outside the loop take part and are running now (the one that creates the
    clock and will drive the run: 1). Time only moves while all of them are blocked in the clock's waits.
    """

    virtual = True

    def __init__(self, threads: int = 1, start: float = 0.0) -> None:
        self._now = start
        self._running = threads
        self._lock = threading.Lock()
        self._loop: VirtualTimeLoop | None = None
        self.jumps = 0  # how often time jumped (the simulator's own cost figure)

    def now(self) -> float:
        return self._now

    # -------------------------------------------------------------- the participants' accounting
    def _block(self) -> _Token:
        token = _Token()
        with self._lock:
            self._running -= 1
            idle = self._running == 0
        if idle and self._loop is not None:
            self._loop.poke()  # it may be in a select waiting for us: let it jump now
        return token

    def _wake(self, token: _Token) -> None:
        """Count the blocked thread of ``token`` as running again (once, whoever gets here first)."""
        with self._lock:
            if not token.woken:
                token.woken = True
                self._running += 1

    def runnable(self) -> bool:
        with self._lock:
            return self._running > 0

    # -------------------------------------------------------------- the waits
    def wait_future(self, future: concurrent.futures.Future, timeout: float | None) -> Any:
        if future.done():
            return future.result()
        token = self._block()
        # Done-callbacks run in the thread that completes the future (the loop's), at completion.
        future.add_done_callback(lambda _: self._wake(token))
        try:
            return future.result(timeout)
        finally:
            self._wake(token)

    def condition(self) -> threading.Condition:
        return _ClockCondition(self)

    def sleep(self, seconds: float) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            with self._lock:  # no loop to coordinate with: the calling thread is the only one
                self._now += max(0.0, seconds)
            return
        self.wait_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(seconds), loop), None)

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("a VirtualClock drives one event loop; this one already has one")
        self._loop = VirtualTimeLoop(self)
        return self._loop

    # -------------------------------------------------------------- the loop's side
    def _advance(self, seconds: float) -> bool:
        """Jump ``seconds`` ahead if nothing outside the loop is running (called by the loop when it is idle)."""
        with self._lock:
            if self._running > 0:
                return False
            self._now += seconds
            self.jumps += 1
            return True

    def _executor_started(self) -> None:
        with self._lock:
            self._running += 1

    def _executor_done(self, _: Any) -> None:
        with self._lock:
            self._running -= 1


class _ClockCondition(threading.Condition):
    """A condition whose waiters count as blocked, and as running from the moment they are notified."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock
        self._tokens: list[_Token] = []

    def wait(self, timeout: float | None = None) -> bool:
        token = self._clock._block()
        self._tokens.append(token)
        try:
            return super().wait(timeout)
        finally:
            self._clock._wake(token)  # after a timeout nobody else did
            if token in self._tokens:
                self._tokens.remove(token)

    def notify(self, n: int = 1) -> None:
        for token in self._tokens[:n]:
            self._clock._wake(token)
        del self._tokens[:n]
        super().notify(n)

    def notify_all(self) -> None:
        self.notify(max(len(self._tokens), len(self._waiters)))  # type: ignore[attr-defined]


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """The loop's selector: real I/O is polled; an idle wait becomes a jump of the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is not None and self._clock._advance(timeout):
            return []
        # Someone outside the loop is running (or nothing is scheduled): wait for real, until they hand the loop
        # work (call_soon_threadsafe) or block (poke); capped so a missed poke costs at most that.
        return super().select(0.05 if timeout is None else min(timeout, 0.05))


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a :class:`VirtualClock`: ``time()`` is the clock's, and idle waits are jumps."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_VirtualSelector(clock))
        self._clock = clock

    def time(self) -> float:
        return self._clock.now()

    def poke(self) -> None:
        """Wake the loop from its select (thread-safe)."""
        if not self.is_closed():
            self._write_to_self()

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future:
        # The worker thread runs outside the loop: count it until its result is back on the loop (the asyncio
        # future's done-callback runs there, after the result arrived), so time cannot jump meanwhile.
        self._clock._executor_started()
        future = super().run_in_executor(executor, func, *args)
        future.add_done_callback(self._clock._executor_done)
        return future
