"""The one pending-call type: the trainer's background call (the weight export beside training) and the rollout
controller's calls on its loop: result, failure, timeout."""

from __future__ import annotations

import threading

import pytest

from areal_core.pending import PendingCall
from areal_core.testing.waits import scaled


def test_result_and_failure_reach_the_caller():
    assert PendingCall.on_thread(lambda: 41 + 1, scaled(5.0), "a background call to add").result() == 42

    def fail():
        raise ValueError("the server went away")

    with pytest.raises(ValueError, match="the server went away"):
        PendingCall.on_thread(fail, scaled(5.0), "a background call to fail").result()


def test_a_call_past_its_timeout_is_named():
    release = threading.Event()
    call = PendingCall.on_thread(release.wait, 0.2,
                                 "a background call to hand the weights of version 7 to the inference engines")
    with pytest.raises(TimeoutError, match="waited 0 s for a background call to hand the weights of version 7"):
        call.result()
    release.set()


def test_a_timeout_raised_by_the_call_itself_keeps_its_message():
    """On Python 3.11+ concurrent.futures.TimeoutError is the builtin: an engine's own timeout (naming its server
    and its wait) must not be rewritten into "waited 1200 s for a background call"."""
    def hung_server():
        raise TimeoutError("waited 30 s (rollout.request_timeout_s) for embedded engine 1 at 127.0.0.1:4242 to "
                           "answer /update_weights")

    with pytest.raises(TimeoutError, match=r"^waited 30 s \(rollout.request_timeout_s\) for embedded engine 1 at "
                                           r"127.0.0.1:4242"):
        PendingCall.on_thread(hung_server, 1200.0,
                              "a background call to hand the weights of version 3 to the inference engines").result()


def test_the_controllers_pending_call_keeps_the_calls_own_timeout_too():
    import concurrent.futures

    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(TimeoutError("waited 30 s for the vllm server at 127.0.0.1:8000 to answer POST /pause"))
    with pytest.raises(TimeoutError, match="^waited 30 s for the vllm server at 127.0.0.1:8000"):
        PendingCall(future, 600.0, "the rollout controller to update weights to version 3").result()
    never: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(TimeoutError, match="^waited 0 s for the rollout controller to pause generation"):
        PendingCall(never, 0.05, "the rollout controller to pause generation").result()


def test_a_timeout_given_to_result_overrides_the_calls_own():
    release = threading.Event()
    call = PendingCall.on_thread(release.wait, 600.0, "a background call that waits")
    with pytest.raises(TimeoutError, match="^waited 0 s for a background call that waits"):
        call.result(timeout=0.05)
    release.set()
    assert call.result(timeout=scaled(5)) is True and call.done()


def test_an_evaluation_is_a_pending_call_that_names_what_it_waited_for():
    """The controller's evaluate() hands back the same pending-call type as its weight updates."""
    import asyncio

    from areal_core.api.workflow import Workflow
    from areal_core.rollout import RolloutController
    from areal_core.testing.scripted_engine import ScriptedInferenceEngine

    gate = threading.Event()

    class HeldWorkflowDouble(Workflow):
        async def arun_episode(self, engine, item):
            while not gate.is_set():
                await asyncio.sleep(0.01)
            return None

    with RolloutController([ScriptedInferenceEngine([[1]])], HeldWorkflowDouble(), batch_size=1) as ctrl:
        pending = ctrl.evaluate(HeldWorkflowDouble(), [1, 2, 3], timeout_s=0.1,
                                waited_for="the evaluation of 3 validation items started after step 4")
        assert isinstance(pending, PendingCall) and not pending.done()
        with pytest.raises(TimeoutError, match="^waited 0 s for the evaluation of 3 validation items started "
                                               "after step 4"):
            pending.result()
        again = ctrl.evaluate(HeldWorkflowDouble(), [1, 2])
        gate.set()
        assert again.result(timeout=scaled(10)) == [None, None]
