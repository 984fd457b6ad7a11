"""The virtual clock: a loop and the threads that wait on it move through simulated time exactly as the schedule
says, jump only when nothing is runnable, and cost little wall time for long simulated spans."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from areal_core.clock import REAL_CLOCK, VirtualClock
from areal_core.testing.waits import scaled


def _run_loop(clock: VirtualClock) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = clock.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with clock.blocked():  # a wall-clock wait the clock must know of: the loop runs in its turn only
        assert started.wait(scaled(10))
    return loop, thread


def _stop(clock: VirtualClock, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    with clock.blocked():
        thread.join(scaled(10))
    assert not thread.is_alive()


def test_timers_on_the_loop_fire_at_their_simulated_times_in_no_wall_time():
    clock = VirtualClock(threads=0)
    loop = clock.new_event_loop()
    seen = []

    async def sleeper(name: str, delays: list[float]) -> None:
        for d in delays:
            await asyncio.sleep(d)
            seen.append((round(loop.time(), 9), name))

    began = time.perf_counter()
    async def main() -> None:
        await asyncio.gather(sleeper("a", [3600.0, 0.5]), sleeper("b", [1800.0, 1800.25]))

    loop.run_until_complete(main())
    loop.close()
    assert seen == [(1800.0, "b"), (3600.0, "a"), (3600.25, "b"), (3600.5, "a")]
    assert time.perf_counter() - began < scaled(1.0)  # an hour and more of simulated time
    assert clock.now() == pytest.approx(3600.5)


def test_a_thread_off_the_loop_holds_time_still_while_it_runs_and_its_sleeps_interleave_with_the_loops():
    clock = VirtualClock(threads=1)
    loop, thread = _run_loop(clock)
    log = []

    async def ticker() -> None:
        for _ in range(5):
            await asyncio.sleep(10.0)
            log.append(("tick", clock.now()))

    future = asyncio.run_coroutine_threadsafe(ticker(), loop)
    # this thread is running: the loop's 10 s timer may not fire, however long we take in wall time
    time.sleep(0.3)
    assert clock.now() == 0.0 and log == []
    clock.sleep(25.0)  # a modelled computation of 25 s: the loop's ticks at 10 and 20 happen meanwhile
    log.append(("slept", clock.now()))
    clock.wait_future(future, scaled(10))
    assert log == [("tick", 10.0), ("tick", 20.0), ("slept", 25.0), ("tick", 30.0), ("tick", 40.0),
                   ("tick", 50.0)]
    _stop(clock, loop, thread)


def test_a_condition_wait_lets_time_move_and_the_notified_thread_is_running_before_the_loop_goes_on():
    clock = VirtualClock(threads=1)
    cond = clock.condition()
    loop, thread = _run_loop(clock)
    box: list[float] = []

    async def producer() -> None:
        await asyncio.sleep(7.0)
        with cond:
            box.append(clock.now())
            cond.notify_all()
        # the waiter was counted as running at notify: this timer cannot fire before it has gone back to sleep
        await asyncio.sleep(1.0)
        box.append(clock.now())

    asyncio.run_coroutine_threadsafe(producer(), loop)
    with cond:
        while not box:
            cond.wait(5)
    seen_at = clock.now()
    time.sleep(0.3)  # running (wall time passes): the loop's next timer must wait for us
    assert len(box) == 1 and clock.now() == seen_at == 7.0
    clock.sleep(0.5)
    assert clock.now() == 7.5 and len(box) == 1
    clock.sleep(1.0)
    assert box == [7.0, 8.0] and clock.now() == 8.5
    _stop(clock, loop, thread)


def test_work_in_the_loops_executor_counts_as_running():
    clock = VirtualClock(threads=0)
    loop = clock.new_event_loop()

    def slow_reward() -> float:
        time.sleep(0.3)  # wall time in a worker thread: simulated time must not move meanwhile
        return clock.now()

    async def main() -> tuple[float, float]:
        timer = asyncio.ensure_future(asyncio.sleep(100.0))
        seen = await loop.run_in_executor(None, slow_reward)
        await timer
        return seen, clock.now()

    assert loop.run_until_complete(main()) == (0.0, 100.0)
    loop.close()


def test_a_future_that_times_out_in_wall_time_leaves_the_waiter_running():
    clock = VirtualClock(threads=1)
    loop, thread = _run_loop(clock)
    never = asyncio.run_coroutine_threadsafe(asyncio.Event().wait(), loop)
    with pytest.raises(TimeoutError):
        clock.wait_future(never, 0.2)
    assert clock.runnable()
    now = clock.now()
    time.sleep(0.2)
    assert clock.now() == now  # still counted as running: nothing jumps
    never.cancel()
    _stop(clock, loop, thread)


def test_the_real_clock_is_the_monotonic_one():
    assert not REAL_CLOCK.virtual
    before = time.monotonic()
    now = REAL_CLOCK.now()
    assert before <= now <= time.monotonic()


def test_lockstep_the_loop_runs_nothing_while_the_driving_thread_runs():
    """What the driving thread does between two waits happens at one instant, before the loop goes on: a
    callback it schedules runs only once it blocks, however long it runs meanwhile."""
    clock = VirtualClock(threads=1)
    loop, thread = _run_loop(clock)
    ran = []
    loop.call_soon_threadsafe(lambda: ran.append(clock.now()))
    time.sleep(0.3)
    assert ran == []  # scheduled, but the driver is running: not the loop's turn
    clock.sleep(1.0)
    assert ran == [0.0]
    _stop(clock, loop, thread)


def test_a_stuck_driver_is_named_after_the_lockstep_timeout():
    clock = VirtualClock(threads=1, lockstep_timeout_s=0.3)
    loop = clock.new_event_loop()
    loop.call_soon(lambda: None)
    with pytest.raises(RuntimeError, match="waited 0 s for the trainer thread to block"):
        loop.run_until_complete(loop.create_future())
    loop.close()
