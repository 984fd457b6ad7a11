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
modelled sleep), :meth:`Clock.condition`'s ``wait``, :meth:`Clock.blocked`,
or the loop's executor. Whoever wakes a blocked thread counts it as runnable
*when it wakes it* (a future's done-callback, a condition's ``notify``),
before the loop goes on: otherwise the loop could jump ahead in the instant
between the wake-up and the thread running again.

**Lockstep, for reproducible runs.** The threads that drive the run (the
trainer's: ``threads`` at construction) and the loop take turns: the loop runs
no callback while a driver runs. What a driver does between two waits
therefore happens at one simulated instant, after everything the loop did
before it and before anything after, whatever the real interleaving would have
been: the same config gives the same simulated run. (Reward workers only hold
time still; the loop waits for their results as it always does.) Why by hand: asyncio's loops read ``time.monotonic`` and
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
from contextlib import contextmanager
from typing import Any, Callable, Iterator


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

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Around any other wall-clock wait of a driving thread (joining a thread): counted as blocked."""
        yield


REAL_CLOCK = Clock()


class _Token:
    """One wait of one thread: ``blocked`` once counted out, ``woken`` once counted back in (by whoever came
    first: the waker, or the waiter itself after a wall-clock timeout)."""

    __slots__ = ("blocked", "woken")

    def __init__(self) -> None:
        self.blocked = False
        self.woken = False


class VirtualClock(Clock):
    """Simulated seconds, shared by one event loop (:meth:`new_event_loop`) and the threads that wait on it.

    ``threads``: how many threads outside the loop take part and are running now (the one that creates the
    clock and will drive the run: 1). Time only moves while all of them are blocked in the clock's waits.
    """

    virtual = True

    def __init__(self, threads: int = 1, start: float = 0.0, lockstep_timeout_s: float = 600.0) -> None:
        self._now = start
        self._drivers = threads  # driving threads running now (the loop waits for none to run)
        self._running = threads  # the same, plus work in the loop's executor (time waits for none to run)
        self._lock = threading.Condition()
        self._loop: VirtualTimeLoop | None = None
        self.lockstep_timeout_s = lockstep_timeout_s
        self.jumps = 0  # how often time jumped (the simulator's own cost figure)

    def now(self) -> float:
        return self._now

    # -------------------------------------------------------------- the participants' accounting
    def _block(self, token: _Token | None = None) -> _Token:
        """Count the calling thread out (unless ``token`` was woken already: its wait is over before it began)."""
        token = token or _Token()
        with self._lock:
            if token.woken:
                return token
            token.blocked = True
            self._running -= 1
            self._drivers -= 1
            idle = self._running == 0
            self._lock.notify_all()
        if idle and self._loop is not None:
            self._loop.poke()  # it may be in a select waiting for us: let it jump now
        return token

    def _wake(self, token: _Token) -> None:
        """Count the blocked thread of ``token`` as running again (once, whoever gets here first)."""
        with self._lock:
            if not token.woken:
                token.woken = True
                if token.blocked:
                    self._running += 1
                    self._drivers += 1

    def runnable(self) -> bool:
        with self._lock:
            return self._running > 0

    # -------------------------------------------------------------- the waits
    def wait_future(self, future: concurrent.futures.Future, timeout: float | None) -> Any:
        if future.done():
            return future.result()
        token = _Token()
        # Done-callbacks run in the thread that completes the future (the loop's), at completion. Registered
        # before counting out: a future done in between would otherwise wake nobody while time jumps on.
        future.add_done_callback(lambda _: self._wake(token))
        self._block(token)
        try:
            return future.result(timeout)
        finally:
            self._wake(token)

    def condition(self) -> threading.Condition:
        return _ClockCondition(self)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        token = self._block()
        try:
            yield
        finally:
            self._wake(token)

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
    def _advance(self, seconds: float, pending: Callable[[], bool]) -> bool:
        """Jump ``seconds`` ahead if nothing outside the loop is running and nothing was handed to the loop
        (``pending()``) since it last looked: a thread may have scheduled a callback and blocked in between."""
        with self._lock:
            if self._running > 0 or pending():
                return False
            self._now += seconds
            self.jumps += 1
            return True

    def _wait_for_drivers(self) -> None:
        """Lockstep: return once no driving thread runs (the loop's turn)."""
        with self._lock:
            if self._drivers <= 0:
                return
            if not self._lock.wait_for(lambda: self._drivers <= 0, self.lockstep_timeout_s):
                raise RuntimeError(
                    f"the simulated run's event loop waited {self.lockstep_timeout_s:.0f} s for the trainer thread "
                    "to block in one of the clock's waits (areal_core.clock): it is stuck, or waits on something "
                    "the clock does not know of (wrap such a wait in clock.blocked())")

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

    # While callbacks are ready the loop polls real I/O only every this many iterations: a simulation runs
    # millions of iterations with no file descriptor but the loop's own wake-up pipe, and the poll (a system call
    # each) was a tenth of its time. A thread's call_soon_threadsafe needs no poll to be seen (it appends to the
    # ready queue directly), so this only delays real I/O by at most this many callbacks' turns.
    POLL_EVERY = 64

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock
        self.pending: Callable[[], bool] = lambda: False  # set by the loop: whether callbacks wait to run
        self._busy_turns = 0

    def select(self, timeout: float | None = None) -> list:
        # Every iteration of the loop selects before it runs its callbacks: the loop's turn begins here, once no
        # driving thread runs (lockstep).
        if timeout == 0:
            self._busy_turns += 1
            events = super().select(0) if self._busy_turns % self.POLL_EVERY == 0 else []
            self._clock._wait_for_drivers()
            return events
        events = super().select(0)
        if events:
            self._clock._wait_for_drivers()
            return events
        if timeout is not None and self._clock._advance(timeout, self.pending):
            return []
        # Someone outside the loop is running (or nothing is scheduled): wait for real, until they hand the loop
        # work (call_soon_threadsafe) or block (poke); capped so a missed poke costs at most that.
        events = super().select(0.05 if timeout is None else min(timeout, 0.05))
        self._clock._wait_for_drivers()
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a :class:`VirtualClock`: ``time()`` is the clock's, and idle waits are jumps."""

    def __init__(self, clock: VirtualClock) -> None:
        selector = _VirtualSelector(clock)
        super().__init__(selector)
        self._clock = clock
        # asyncio's queue of ready callbacks (a private attribute, the same from 3.10 to 3.13): call_soon_threadsafe
        # appends to it before the caller can block
        selector.pending = lambda: bool(self._ready)

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
