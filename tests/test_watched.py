"""``areal_core.rollout.elastic.watched``: an engine call awaited in the caller's own task, cancelled in place when
its server leaves routing or its time runs out. A cancellation of ours must never outlive the call (the task
goes on to other awaits), and a caller's own cancellation must still arrive."""

from __future__ import annotations

import asyncio

import pytest

from areal_core.rollout.elastic import INLINE_CALLS, Deadlines, Member, WatchEnded, watched
from areal_core.testing.waits import scaled

pytestmark = pytest.mark.skipif(not INLINE_CALLS, reason="Python < 3.11: calls run in a task of their own (settle)")


class _EngineDouble:
    """Test double: nothing but a name; the calls below are plain coroutines."""


def within(seconds: float) -> Deadlines:
    """The timeouts of calls of this length, on the running loop (what the InterruptibleEngine keeps)."""
    return Deadlines(asyncio.get_running_loop(), seconds)


def member() -> Member:
    return Member(_EngineDouble(), "double")


async def answer(value, delay: float = 0.0):
    await asyncio.sleep(delay)
    return value


def test_the_answer_comes_back_and_nothing_is_left_to_cancel():
    async def main():
        m = member()
        assert await watched(m, answer(7, 0.01), within(5)) == 7
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.02)  # nothing of ours fires later

    asyncio.run(main())


def test_a_server_leaving_routing_ends_the_call_in_place():
    async def main():
        m = member()
        ended = asyncio.Event()

        async def slow():
            try:
                await asyncio.sleep(10)
            finally:
                ended.set()

        asyncio.get_running_loop().call_later(0.01, m.mark_lost)
        with pytest.raises(WatchEnded) as info:
            await watched(m, slow(), within(5))
        assert info.value.reason == "lost" and ended.is_set()
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)  # the task goes on uncancelled

    asyncio.run(main())


def test_the_timeout_ends_the_call():
    async def main():
        with pytest.raises(WatchEnded) as info:
            await watched(member(), answer(1, 10), within(0.02))
        assert info.value.reason == "timeout" and asyncio.current_task().cancelling() == 0

    asyncio.run(main())


def test_a_callers_cancellation_still_arrives():
    async def main():
        task = asyncio.create_task(watched(member(), answer(1, 10), within(5)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_call_that_turns_our_cancellation_into_its_own_error_leaves_no_cancellation_behind():
    async def main():
        m = member()

        async def converting():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                raise ConnectionError("server gone") from None

        asyncio.get_running_loop().call_later(0.01, m.mark_lost)
        with pytest.raises(ConnectionError):
            await watched(m, converting(), within(5))
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)  # and the next await is not cancelled
        # the next call on another server runs to its end
        assert await watched(member(), answer(3, 0.01), within(5)) == 3

    asyncio.run(main())


def test_a_loss_as_the_call_finishes_or_after_it_never_cancels_what_the_task_does_next():
    """The server leaves routing in the same loop turn the answer arrives (the answer or WatchEnded, either is
    right: the request continues elsewhere from what it has), or once the task has moved on: no cancellation of
    ours may reach the task's next await."""
    async def main():
        loop = asyncio.get_running_loop()
        for lose_in_same_turn in (True, False):
            m = member()
            done = loop.create_future()

            async def call():
                return await done

            def finish():
                done.set_result("answer")  # wakes the task ...
                if lose_in_same_turn:
                    m.mark_lost()  # ... and the server leaves before the task runs

            loop.call_soon(finish)
            try:
                outcome = await watched(m, call(), within(5))
            except WatchEnded as ended:
                outcome = ended.reason
            assert outcome in ("answer", "lost")
            if not lose_in_same_turn:
                assert outcome == "answer"
                loop.call_soon(m.mark_lost)  # the server leaves while the task does something else
            await asyncio.sleep(0.01)  # not cancelled
            assert asyncio.current_task().cancelling() == 0 and not m.watchers

    asyncio.run(main())


def test_waits_that_share_a_timeout_each_time_out_at_their_own_deadline_on_one_timer():
    """``settle``'s timeouts: one FIFO per timeout length and one loop timer for its head. Waits that end early
    never fire; the others fire no sooner than their own deadline, in order."""
    async def main():
        loop = asyncio.get_running_loop()
        queue = within(0.05)
        fired: list[tuple[int, float]] = []
        began = loop.time()
        entries, added = [], {}
        for i in range(6):
            if i == 3:
                await asyncio.sleep(0.02)  # the second three come later, with later deadlines
            added[i] = loop.time() - began
            entries.append(queue.add(lambda i=i: fired.append((i, loop.time() - began))))
            if i in (1, 4):  # these waits end before their deadline (no await in between: no race)
                queue.done(entries[i])
        # until the last deadline's wait has fired (FIFO: any wrongly fired wait of 1 or 4 came before it),
        # however late this loop runs
        while 5 not in [i for i, _ in fired]:
            assert loop.time() - began < scaled(10), f"waits fired so far: {fired}"
            await asyncio.sleep(0.01)
        assert [i for i, _ in fired] == [0, 2, 3, 5]
        for i, at in fired:
            assert at >= added[i] + 0.05 - 1e-3
        for e in entries:
            queue.done(e)
        assert not queue.queue and queue.timer is None  # nothing left behind

    asyncio.run(main())
