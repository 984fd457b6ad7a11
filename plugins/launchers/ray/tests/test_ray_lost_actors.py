"""How the Ray launcher names an actor it lost, whatever Ray raised for it (no cluster needed: ``ray.get`` is
replaced by one that raises what Ray raises)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from areal_plugin_ray.launcher import RaySession, RunFailed  # noqa: E402


def raising(exc):
    def get(ref, timeout=None):
        raise exc
    return get


def test_rays_memory_monitor_kill_is_a_lost_actor_not_a_traceback(monkeypatch):
    import ray
    from ray.exceptions import OutOfMemoryError

    killed = OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node was 95%")
    monkeypatch.setattr(ray, "get", raising(killed))
    code, why = RaySession._outcome(None, object())
    assert code is None
    assert why == ("was lost: its Ray actor was killed by Ray's memory monitor (its node ran low on memory) "
                   "(Task was killed due to the node running low on memory.)")

    class Session:
        options = type("Options", (), {"startup_timeout_s": 5.0})()

    with pytest.raises(RunFailed, match=r"the Ray actor was killed by Ray's memory monitor \(its node ran low on "
                                        r"memory\) while waiting for a plugin report: Task was killed"):
        RaySession._get(Session(), object(), "a plugin report")


def test_an_actor_that_died_is_still_named_so(monkeypatch):
    import ray
    from ray.exceptions import RayActorError

    monkeypatch.setattr(ray, "get", raising(RayActorError()))
    code, why = RaySession._outcome(None, object())
    assert code is None and why.startswith("was lost: its Ray actor died (")
