"""areal_core.threads: helper threads run torch on one core, so OpenMP keeps a single multi-threaded team per
process (a second one throttles the first: see the module's docstring)."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")

from areal_core.rollout import RolloutController  # noqa: E402
from areal_core.threads import serial_torch, torch_threads  # noqa: E402
from areal_core.testing.latency_engine import GroupWorkflowDouble, LatencyEngineDouble  # noqa: E402
from areal_core.testing.waits import scaled  # noqa: E402


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def in_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join(scaled(30))
    assert not t.is_alive(), f"the helper thread did not finish within {scaled(30):.0f} s"
    return box[0]


def test_serial_torch_sets_the_calling_thread_only(two_threads):
    def helper():
        serial_torch()
        (torch.randn(1 << 20) * 2).sum()  # a parallel-sized op runs without error on one thread
        return torch.get_num_threads()

    assert in_thread(helper) == 1
    assert torch.get_num_threads() == 2  # the thread that trains keeps its cores


def test_rollout_controller_threads_are_serial(two_threads):
    """The controller's event loop thread and its executor threads (rewards, weight staging, collectives) run
    torch on one thread; the trainer's own thread keeps its count."""
    ctrl = RolloutController([LatencyEngineDouble()], GroupWorkflowDouble(2), batch_size=1, max_head_offpolicyness=0)
    with ctrl:
        async def counts():
            on_loop = torch.get_num_threads()
            in_executor = await asyncio.get_running_loop().run_in_executor(None, torch.get_num_threads)
            in_to_thread = await asyncio.to_thread(torch.get_num_threads)
            return on_loop, in_executor, in_to_thread

        assert ctrl._call(counts(), "thread counts") == (1, 1, 1)
    assert torch.get_num_threads() == 2


def test_torch_threads_sets_the_block_and_restores_the_count_even_on_error(two_threads):
    """A weight load's copies run on one thread (the embedded server, the fsdp export); the thread's count comes
    back after the block, also when the block raises."""
    seen = []
    with torch_threads(1):
        seen.append(torch.get_num_threads())
        target = torch.empty(1 << 20)
        target.copy_(torch.ones(1 << 20))
    assert seen[0] == 1 and torch.get_num_threads() == 2 and bool((target == 1).all())
    with pytest.raises(RuntimeError, match="half way"):
        with torch_threads(1):
            raise RuntimeError("half way")
    assert torch.get_num_threads() == 2
    with torch_threads(2):  # already so: nothing to change
        assert torch.get_num_threads() == 2
