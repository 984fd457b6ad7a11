"""The rollout controller against a deterministic engine double: staleness,
conservation, synchronous order at eta = 0, interruption, filtering, stalls."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.clock import VirtualClock
from areal_core.rollout import RolloutController, RolloutError, StallError, has_reward_variance, pack_groups
from areal_core.rollout.staleness import StalenessManager
from areal_core.testing.latency_engine import GroupWorkflowDouble, LatencyEngineDouble, items, token_for
from areal_core.testing.waits import scaled


def controller(engines, *, batch_size, eta, max_concurrent=64, group_size=2, **kw):
    return RolloutController(engines, GroupWorkflowDouble(group_size), batch_size=batch_size,
                             max_head_offpolicyness=eta, max_concurrent_rollouts=max_concurrent, **kw)


def train_steps(ctrl, data, steps, check=None):
    """Run `steps` trainer steps: take a batch, check it, update weights to version + 1."""
    batches = []
    for _ in range(steps):
        batch = ctrl.prepare_batch(data, timeout=scaled(30))
        if check:
            check(ctrl, batch)
        batches.append(batch)
        ctrl.update_weights_from_disk(f"/ckpt/v{ctrl.version + 1}", ctrl.version + 1)
    return batches


def test_capacity_formula():
    m = StalenessManager(batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=6)
    assert m.capacity(0) == 6  # concurrency binds: min(6 - 0, 2 * 4 - 0)
    for _ in range(6):
        m.on_start()
    assert m.capacity(0) == 0
    m.on_accept(); m.on_accept(); m.on_reject()
    # running 3, accepted 2: min(6 - 3, (1 + 0 + 1) * 4 - (2 + 3)) = 3
    assert m.capacity(0) == 3
    assert m.capacity(1) == 3
    assert StalenessManager(2, 0, 100).capacity(0) == 2


def test_hand_out_waits_for_a_running_group_that_would_break_the_bound():
    """The hand-out half of the bound, alone: eta 1, batch 2, trained at version 2. Handing out the two
    oldest ready groups (started at 1) leaves a running group started at 0, due by version 1: it must be
    trained now, so the batch waits for it. Without it running, or with the ready groups themselves overdue
    (waiting would never end), the oldest go out."""
    m = StalenessManager(batch_size=2, max_head_offpolicyness=1, max_concurrent_rollouts=100)
    assert not m.may_hand_out([1, 1, 2], [0], count=2, version=2)
    assert m.may_hand_out([1, 1, 2], [], count=2, version=2)
    assert m.may_hand_out([0, 0, 0], [0], count=2, version=2)  # the ready ones alone overflow: no wait helps
    assert not m.may_hand_out([1], [], count=2, version=2)  # not enough ready
    assert m.may_hand_out([1, 2], [2], count=2, version=2)  # the running group is due later


def test_pacing_lead_grows_when_the_trainer_waits_and_shrinks_when_a_batch_is_spare():
    m = StalenessManager(batch_size=2, max_head_offpolicyness=3, max_concurrent_rollouts=100, pacing=True)
    assert m.lead == 1 and m.capacity(0) == (1 + 0 + 1) * 2  # starts one version ahead, not eta
    assert m.on_hand_out(waited=True, ready=0) and m.lead == 2  # grew: admission may open
    assert m.capacity(0) == (2 + 0 + 1) * 2
    m.on_hand_out(waited=True, ready=1)
    assert not m.on_hand_out(waited=True, ready=0) and m.lead == 3  # never past eta
    m.on_hand_out(waited=False, ready=3)  # less than a whole spare batch beside the one taken: kept
    assert m.lead == 3
    assert not m.on_hand_out(waited=False, ready=4) and m.lead == 2
    m.on_hand_out(waited=False, ready=9)
    m.on_hand_out(waited=False, ready=9)
    assert m.lead == 1  # never below one version ahead
    unpaced = StalenessManager(2, 3, 100, pacing=False)
    unpaced.on_hand_out(waited=False, ready=100)
    assert unpaced.lead == 3 and unpaced.capacity(0) == 8
    for eta in (0, 1):  # nothing between 1 and eta to adapt
        tight = StalenessManager(2, eta, 100, pacing=True)
        tight.on_hand_out(waited=True, ready=0)
        assert not tight.pacing and tight.lead == eta


def paced_run(pacing: bool, phases: list[tuple[float, float, int]]) -> list[tuple[list[int], int]]:
    """Per phase (token latency s, train step s, steps): each batch's largest episode lag (trainer version -
    start version), and the lead at the phase's end. Both latencies are simulated time (areal_core.clock), so
    which side is slower is what the phase says, however fast or loaded the machine."""
    data = items(400, seed=5, max_length=4)
    engine = LatencyEngineDouble(seed=5)
    clock = VirtualClock(threads=1)
    out = []
    with controller([engine], batch_size=2, eta=3, pacing=pacing, clock=clock) as ctrl:
        for token_latency_s, train_s, steps in phases:
            engine.max_token_latency_s = token_latency_s
            lags = []
            for _ in range(steps):
                batch = ctrl.prepare_batch(data, timeout=scaled(30))
                lags.append(max(ctrl.version - g.start_version for g in batch))
                clock.sleep(train_s)
                ctrl.update_weights_from_disk(f"/ckpt/v{ctrl.version + 1}", ctrl.version + 1)
            out.append((lags, ctrl.stats()["lead"]))
    return out


def test_pacing_keeps_samples_one_version_old_when_generation_outpaces_training():
    # Generating a batch takes a few ms, a train step 100 ms: unpaced, the queue fills to the bound.
    [(unpaced, lead)] = paced_run(False, [(0.0005, 0.1, 10)])
    assert max(unpaced[5:]) == 3 and lead == 3
    [(paced, lead)] = paced_run(True, [(0.0005, 0.1, 10)])
    assert max(paced[5:]) <= 1 and lead == 1


def test_pacing_follows_whichever_side_is_slower():
    # First generation is slow (~100 ms a batch) and training instant: the trainer waits, the lead climbs to
    # eta. Then generation gets fast and training slow: the lead comes back down and samples get fresh again.
    (_, lead_slow_generation), (lags, lead_slow_training) = paced_run(True, [(0.05, 0.0, 6), (0.0005, 0.1, 10)])
    assert lead_slow_generation == 3
    assert lead_slow_training == 1 and max(lags[-3:]) <= 1


def test_eta_zero_is_synchronous_order():
    data = items(40, seed=3)
    with controller([LatencyEngineDouble(seed=1)], batch_size=4, eta=0) as ctrl:
        batches = train_steps(ctrl, data, 5)
    assert [[g.item["id"] for g in b] for b in batches] == [list(range(4 * k, 4 * k + 4)) for k in range(5)]
    assert all(g.start_version == k for k, b in enumerate(batches) for g in b)


@settings(max_examples=20, deadline=None)
@given(batch_size=st.integers(1, 4), max_concurrent=st.integers(1, 12), seed=st.integers(0, 10**6),
       n_engines=st.integers(1, 3))
def test_eta_zero_reproduces_synchronous_order_under_random_latencies(batch_size, max_concurrent, seed, n_engines):
    data = items(100, seed=seed, max_length=5)
    engines = [LatencyEngineDouble(seed=seed + i, max_token_latency_s=0.001) for i in range(n_engines)]
    with controller(engines, batch_size=batch_size, eta=0, max_concurrent=max_concurrent) as ctrl:
        batches = train_steps(ctrl, data, 3)
    assert [[g.item["id"] for g in b] for b in batches] == [
        list(range(batch_size * k, batch_size * (k + 1))) for k in range(3)]
    assert all(set(t.versions[4:]) == {k} for k, b in enumerate(batches) for g in b for t in g.trajectories)


@settings(max_examples=60, deadline=None)
@given(eta=st.integers(0, 3), batch_size=st.integers(1, 4), max_concurrent=st.integers(1, 12),
       seed=st.integers(0, 10**6), n_engines=st.integers(1, 3), group_size=st.integers(1, 2), pacing=st.booleans())
def test_staleness_bound_and_conservation_hold_under_random_latencies(eta, batch_size, max_concurrent, seed,
                                                                     n_engines, group_size, pacing):
    data = items(200, seed=seed, max_length=6)
    engines = [LatencyEngineDouble(seed=seed + i, max_token_latency_s=0.001) for i in range(n_engines)]
    seen = []

    def check(ctrl, batch):
        v = ctrl.version
        s = ctrl.stats()
        assert s["started"] == s["accepted"] + s["rejected"] + s["running"]  # conservation
        assert s["accepted"] == s["consumed"] + s["ready"]
        assert s["running"] <= max_concurrent
        for g in batch:
            assert v - g.start_version <= eta, (v, g.start_version, eta)
            for t in g.trajectories:
                produced = [ver for ver, m in zip(t.versions, t.loss_mask) if m]
                assert all(v - ver <= eta for ver in produced)
                assert produced == sorted(produced)  # versions only move forward within a sequence
        seen.extend(g.item["id"] for g in batch)

    with controller(engines, batch_size=batch_size, eta=eta, max_concurrent=max_concurrent,
                    group_size=group_size, pacing=pacing) as ctrl:
        train_steps(ctrl, data, 4, check)
        assert 1 <= ctrl.stats()["lead"] <= eta if pacing and eta > 1 else ctrl.stats()["lead"] == eta
    assert len(seen) == len(set(seen)) == 4 * batch_size  # nothing handed out twice


def test_interrupted_requests_continue_under_new_weights_and_lose_no_token():
    data = [{"id": i, "length": 40} for i in range(4)]
    engine = LatencyEngineDouble(seed=0, max_token_latency_s=0.004)
    clock = VirtualClock(threads=1)  # simulated time: the update lands mid-generation however loaded the machine
    with controller([engine], batch_size=2, eta=1, group_size=1, clock=clock) as ctrl:
        ctrl.set_source(data)
        clock.sleep(0.05)  # episodes are mid-generation (40 tokens of up to 4 ms each)
        paused_s = ctrl.update_weights_from_disk("/ckpt/v1", 1)
        batch = ctrl.wait(2, timeout=scaled(30))
    assert engine.aborts > 0 and engine.updates == [("/ckpt/v1", 1)]
    assert paused_s < 1.0
    mixed = [t for g in batch for t in g.trajectories if len(set(t.versions[4:])) == 2]
    assert mixed, "no trajectory spans the weight update"
    for t in mixed:
        out = t.tokens[4:]
        assert len(out) == 40 and t.info["stop_reason"] == "length"
        # token-for-token what an uninterrupted engine emits at each position: nothing lost or repeated
        assert out == [token_for(t.info["rid"], 4 + i) for i in range(40)]
        switch = t.versions[4:].index(1)
        assert t.versions[4:] == [0] * switch + [1] * (40 - switch)
        assert t.logprobs[4:] == [-0.5] * switch + [-1.5] * (40 - switch)


def test_dynamic_filtering_over_samples_until_the_batch_is_full():
    data = [{"id": i, "length": 2, "rewards": [1.0, 1.0] if i % 3 else [0.0, 1.0]} for i in range(60)]
    with controller([LatencyEngineDouble()], batch_size=3, eta=1, should_accept=has_reward_variance) as ctrl:
        batches = train_steps(ctrl, data, 3)
        stats = ctrl.stats()
    assert [g.item["id"] for b in batches for g in b] == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    assert stats["rejected"] + stats["running"] >= 16  # ids 1, 2, 4, ..., 23: each admitted before 24


def test_stall_error_names_the_counts():
    data = [{"id": i, "length": 1, "rewards": [1.0, 1.0]} for i in range(5)]
    with controller([LatencyEngineDouble()], batch_size=2, eta=0, should_accept=has_reward_variance) as ctrl:
        with pytest.raises(StallError) as err:
            ctrl.prepare_batch(data, timeout=scaled(30))
    assert str(err.value) == (
        "the data source ran dry: a batch needs 2 accepted groups but only 0 are ready, none running; "
        "5 episodes started, 5 rejected by the workflow or should_accept. Fix: give the dataset more items "
        "(or more epochs), or accept more groups (e.g. dynamic filtering off)")


def test_workflow_crash_surfaces_with_the_item():
    data = [{"id": 0}]  # no "length": the workflow double raises KeyError
    with controller([LatencyEngineDouble()], batch_size=1, eta=0) as ctrl:
        with pytest.raises(RolloutError, match=r"workflow GroupWorkflowDouble failed on item #0 \(\{'id': 0\}\): "
                                               r"KeyError: 'length'"):
            ctrl.prepare_batch(data, timeout=scaled(30))


def test_wait_timeout_says_what_it_waited_for():
    with controller([LatencyEngineDouble(max_token_latency_s=0.5)], batch_size=1, eta=0) as ctrl:
        ctrl.submit({"id": 0, "length": 100})
        with pytest.raises(TimeoutError, match=r"waited 0 s for 1 accepted rollout groups: 0 ready, 1 running"):
            ctrl.wait(1, timeout=0.2)


def test_sync_rewards_run_off_the_loop():
    from areal_core.api import call_reward

    loop_threads = []
    # each call returns only once another is running beside it: calls serialised on one thread would break it
    pairs = threading.Barrier(2, timeout=scaled(30))

    def slow_reward(prompt, completion, item):
        loop_threads.append(threading.current_thread().name)
        pairs.wait()
        return 1.0

    class RewardingWorkflow(GroupWorkflowDouble):
        async def arun_episode(self, engine, item):
            trajs = await super().arun_episode(engine, item)
            results = await asyncio.gather(*(call_reward(slow_reward, "", "", item) for _ in trajs))
            for t, r in zip(trajs, results):
                t.reward = r.reward
            return trajs

    ctrl = RolloutController([LatencyEngineDouble()], RewardingWorkflow(4), batch_size=2, max_head_offpolicyness=0)
    with ctrl:
        batch = ctrl.prepare_batch([{"id": i, "length": 1} for i in range(2)], timeout=scaled(30))
    assert all(name.startswith("areal-reward") for name in loop_threads)
    assert len(loop_threads) == 8 and not pairs.broken  # in parallel in the pool, not serialised on the loop
    assert [g.rewards for g in batch] == [[1.0] * 4] * 2


def test_resume_skips_done_items_and_redoes_in_flight_ones():
    data = items(30, seed=5)
    with controller([LatencyEngineDouble()], batch_size=2, eta=2) as ctrl:
        first = train_steps(ctrl, data, 3)
        state = ctrl.state_dict()
    trained = [g.item["id"] for b in first for g in b]
    with controller([LatencyEngineDouble()], batch_size=2, eta=2) as resumed:
        resumed.load_state_dict(state)
        with pytest.raises(RuntimeError, match="restored at version 3 but the engines serve version 0"):
            resumed.prepare_batch(data, timeout=scaled(5))
        resumed.update_weights_from_disk("/ckpt/v3", 3)  # the trainer hands the restored weights over first
        assert resumed.version == 3 and resumed.engines[0].version == 3
        later = train_steps(resumed, data, 3)
    again = [g.item["id"] for b in later for g in b]
    assert not set(trained) & set(again)
    assert sorted(trained + again) == list(range(12))  # nothing skipped, nothing twice


def test_pack_groups_is_padding_free():
    data = [{"id": 0, "length": 3}, {"id": 1, "length": 1}]
    with controller([LatencyEngineDouble()], batch_size=2, eta=0) as ctrl:
        batch = pack_groups(ctrl.prepare_batch(data, timeout=scaled(30)))
    assert batch["seq_lens"] == [7, 7, 5, 5]
    assert batch["cu_seqlens"] == [0, 7, 14, 19, 24]
    assert len(batch["input_ids"]) == len(batch["versions"]) == len(batch["logprobs"]) == 24
    assert batch["position_ids"][:9] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert batch["group_index"] == [0, 0, 1, 1]
