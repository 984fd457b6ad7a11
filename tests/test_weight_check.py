"""The integrity gate on weight updates (``rollout.weight_check``, :mod:`areal_core.weight_check`): the trainer's
real hand-over (:class:`~areal_core.trainer_weights.WeightHandOver`) through the real rollout controller to engine
doubles with a loader bug (tests/doubles/weight_engine_doubles.py). A bug is caught at the first update, named;
the embedded engine's real server is checked in plugins/engines/local/tests/test_local_weight_check.py."""

from __future__ import annotations

import time

import pytest
import torch

from areal_core.config.schema import RunConfig
from areal_core.rollout.elastic import ACTIVE, DOWN
from areal_core.testing import tiny_model
from areal_core.testing.latency_engine import LatencyEngineDouble
from areal_core.testing.waits import scaled, wait_until
from areal_core.weight_check import (NOT_CHECKABLE, WeightCheckError, compare_digests, compare_probe, digest_named,
                                     not_checkable, probe_due, tensor_digest)
from weight_engine_doubles import FaultyEngineDouble, HandOverRig

TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("weights") / "model", seed=0))


def config(**rollout) -> RunConfig:
    cfg = RunConfig()
    cfg.model.dtype = "float32"
    cfg.rollout.max_head_offpolicyness = 0
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    cfg.rollout.weight_sync = "tensors"
    return cfg


@pytest.fixture
def setup(model, tmp_path):
    made: list[HandOverRig] = []

    def make(*faults, **kwargs) -> HandOverRig:
        made.append(HandOverRig(model, tmp_path, list(faults), **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


# ------------------------------------------------------------------ the digest itself
def test_the_digest_sees_a_permutation_a_flipped_element_and_a_dtype_and_sample_mode_the_first():
    t = torch.randn(256, 128)
    same = tensor_digest(t.clone())
    assert tensor_digest(t) == same and same.startswith("float32[256,128]:")
    flipped = t.clone()
    flipped.view(-1)[1000] += 1e-3
    assert tensor_digest(flipped) != same
    assert tensor_digest(t.flip(0)) != same
    assert tensor_digest(t.flip(0), "sample") != tensor_digest(t, "sample")
    assert tensor_digest(t.to(torch.bfloat16)) != same
    assert tensor_digest(t.t()) != same  # the logical layout is hashed: a transposed copy is another tensor
    assert tensor_digest(t.t().contiguous().t()) == same  # the same values stored differently: the same digest


def test_digests_compare_by_name_and_say_what_differs():
    a, b = torch.ones(4), torch.zeros(4)
    sent = digest_named([("x", a), ("y", b)])
    assert compare_digests(sent, digest_named([("x", a), ("y", b), ("extra", a)])) == []
    differences = compare_digests(sent, digest_named([("x", b)]))
    assert differences[0].startswith("x: sent float32[4]:") and "the engine holds float32[4]:" in differences[0]
    assert differences[1].startswith("y: sent") and "reports no such tensor" in differences[1]


@pytest.mark.parametrize("mode", ["on", "sample"])
def test_digests_taken_on_several_threads_are_the_ones_taken_on_one(mode):
    """digest_named(workers=4): every name gets its own tensor's digest (aliases, views, empty tensors, order)."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 200, generator=g)
    named = [(f"t{i}", torch.randn(64 + i, generator=g)) for i in range(12)]
    named += [("big", big), ("alias", big), ("rows", big[:100]), ("empty", torch.zeros(0)), ("empty2", torch.ones(0)),
              ("bf16", big.to(torch.bfloat16)), ("ints", torch.arange(10))]
    one = digest_named(named, mode)
    assert list(one) == [name for name, _ in named]
    assert one == {name: tensor_digest(t, mode) for name, t in named}
    assert digest_named(named, mode, workers=4) == one


def test_a_tensor_the_engine_cannot_digest_is_skipped_and_listed_with_its_reason():
    sent = digest_named([("x", torch.ones(4)), ("y", torch.zeros(4))])
    held = {"x": f"{NOT_CHECKABLE}: quantised (fp8)", "y": sent["y"]}
    assert compare_digests(sent, held) == [] and not_checkable(sent, held) == {"x": "quantised (fp8)"}
    assert not_checkable(sent, sent) == {}


def test_a_tensor_the_trainers_side_cannot_place_is_skipped_listed_and_the_rest_still_judged():
    """An engine's sent_digests may mark a tensor not checkable (it cannot say what its server will report for
    it): skipped whatever the engine reports, even nothing, listed with the reason; the other tensors judged."""
    sent = {**digest_named([("y", torch.zeros(4))]), "x": f"{NOT_CHECKABLE}: no place in the server's layout"}
    assert compare_digests(sent, {"y": sent["y"]}) == []
    assert not_checkable(sent, {"y": sent["y"]}) == {"x": "no place in the server's layout"}
    assert not_checkable(sent, {"x": f"{NOT_CHECKABLE}: quantised"}) == {"x": "no place in the server's layout"}
    (difference,) = compare_digests(sent, digest_named([("y", torch.ones(4))]))
    assert difference.startswith("y: sent float32[4]:")


def test_the_probe_runs_at_the_first_update_and_every_nth():
    assert [u for u in range(1, 32) if probe_due(u, 10)] == [1, 10, 20, 30]
    assert not any(probe_due(u, 0) for u in range(1, 20))
    assert compare_probe([5, 6], [-1.0, -2.0], [-1.005, -2.005], "float32") == []
    assert compare_probe([5, 6], [-1.0, -2.0], [-1.0, -3.0], "float32")[0] == \
        "token 1 (id 6): engine -2.0000, trainer -3.0000"
    assert compare_probe([5, 6], [-1.0, -2.0], [-1.3, -2.1], "bfloat16") == []
    assert "mean difference 0.3000 nats" in compare_probe([5, 6], [-1.0, -2.0], [-1.3, -2.3], "bfloat16")[0]


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("engine, trainer, gave_none", [
    ([NAN, NAN], [-1.0, -2.0], "engine"),      # an engine serving NaN: NaN compares as no gap
    ([-1.0, -2.0], [NAN, NAN], "trainer"),
    ([None, None], [-1.0, -2.0], "engine"),    # NaN as JSON null: None - float raised TypeError
    ([NAN, NAN], [None, None], "engine and trainer"),
    (["-1.0", -2.0], [-1.0, -2.0], "engine"),  # text is no logprob
    ([INF, -2.0], [-1.0, -2.0], "engine"),     # no logprob is positive
])
def test_the_probe_sees_nan_null_and_inf_as_differences(engine, trainer, gave_none):
    differences = compare_probe([5, 6], engine, trainer, "bfloat16")
    assert differences[0] == f"token 0 (id 5): engine {engine[0]!r}, trainer {trainer[0]!r} (the {gave_none} gave no " \
                             f"finite logprob)"
    assert differences[-1] == "allowed per token in bfloat16: 1.0 nats"


def test_the_probe_agrees_on_minus_inf_only_when_both_sides_say_it():
    assert compare_probe([5, 6], [-INF, -2.0], [-INF, -2.0], "float32") == []
    assert compare_probe([5, 6], [-INF, -2.0], [-1.0, -2.0], "float32")[0] == \
        "token 0 (id 5): engine -inf, trainer -1.0000"


def test_a_digest_that_is_not_text_is_a_difference():
    sent = digest_named([("x", torch.zeros(4)), ("y", torch.ones(4))])
    assert compare_digests(sent, {"x": NAN, "y": None}) == [
        f"x: sent {sent['x']}, the engine reports nan, not a digest",
        f"y: sent {sent['y']}, the engine reports no such tensor"]
    assert not_checkable(sent, {"x": 3}) == {}


# ------------------------------------------------------------------ the gate, through the real hand-over
def test_healthy_engines_pass_every_update_with_digests_and_the_probe(setup):
    s = setup("", "", weight_probe_every=2)
    for _ in range(3):
        s.update()
    s.handover.finish()  # update 3 is checked beside generation (weight_check_holds=training): its end
    assert [e.version for e in s.engines] == [3, 3] and [e.digest_calls for e in s.engines] == [3, 3]
    assert s.handover.probe_s > 0 and s.controller.probe_results  # probed at updates 1 and 2
    assert s.handover.digest_s > 0 and s.controller.fleet.weight_failures == []


@pytest.mark.parametrize("holds", ["generation", "training"])
@pytest.mark.parametrize("fault", [f"permute:{TENSOR}", f"corrupt:{TENSOR}", "skip:model.layers.1."])
def test_a_loader_bug_is_caught_at_the_first_update_with_the_tensor_named(setup, fault, holds):
    s = setup("", fault, weight_probe_every=0, weight_check_holds=holds)
    with pytest.raises(WeightCheckError) as error:
        s.update()
        # rollout.weight_check_holds=training: the update returns once the engines serve the version, the check
        # goes on beside generation, and the trainer's next hand-out is where it fails
        assert holds == "training"
        s.controller.wait(1, timeout=scaled(30))
    message = str(error.value)
    assert "inference server server-1 does not serve the weights of version 1" in message
    assert TENSOR in message and "server-0" not in message
    if fault.startswith("skip"):
        assert "model.layers.1.self_attn.q_proj.weight" in message  # every tensor of the skipped bucket
    states = {m.name: m.state for m in s.controller.members()}
    assert states == {"server-0": ACTIVE, "server-1": DOWN}  # it takes no traffic


def test_tensors_an_engine_cannot_digest_pass_unchecked_and_the_run_log_names_them_once(setup, caplog):
    s = setup("", f"uncheckable:{TENSOR}", weight_probe_every=0)
    with caplog.at_level("WARNING", logger="areal.rollout"):
        for _ in range(2):
            s.update()
    assert s.controller.fleet.weight_failures == [] and [e.version for e in s.engines] == [2, 2]
    lines = [r.getMessage() for r in caplog.records if "cannot digest" in r.getMessage()]
    assert len(lines) == 1 and "server-1" in lines[0] and TENSOR in lines[0] and "quantised" in lines[0], lines


def test_sample_mode_catches_a_permutation_too(setup):
    s = setup(f"permute:{TENSOR}", weight_check="sample", weight_probe_every=0)
    with pytest.raises(WeightCheckError, match=TENSOR):
        s.update()
        s.handover.finish()  # the check ran beside generation: the trainer's wait for it raises


def test_with_the_gate_off_nothing_is_checked(setup):
    s = setup(f"permute:{TENSOR}", weight_check="off")
    s.update()
    assert s.engines[0].digest_calls == 0 and s.engines[0].version == 1


def test_a_wrong_dtype_cast_the_digests_miss_is_caught_by_the_parity_probe(setup):
    s = setup("", f"cast:{TENSOR}")
    with pytest.raises(WeightCheckError) as error:
        s.update()
    message = str(error.value)
    assert "server-1" in message and "the parity probe" in message and "token 0" in message
    assert s.engines[1].digest_calls == 1  # its digests matched: what it holds is right, what it computes with is not
    assert {m.name: m.state for m in s.controller.members()}["server-1"] == DOWN


def test_elastic_drops_the_engine_and_reloads_it(setup):
    s = setup("", f"permute:{TENSOR}", elastic=True, weight_probe_every=0)
    s.update()  # no error: the run goes on
    assert len(s.controller.fleet.weight_failures) == 1 and TENSOR in str(s.controller.fleet.weight_failures[0])
    wait_until(lambda: s.made and s.made[0].version == 1 and len(s.controller.engines) == 2, 30,
               "the reloaded server to rejoin", 0.05)
    assert s.made[0].digest_calls == 1  # the joiner was checked before it took traffic
    s.update()
    assert [e.version for e in s.controller.engines] == [2, 2]


@pytest.mark.parametrize("holds", ["generation", "training"])
@pytest.mark.parametrize(("delay", "phase"), [("digest_delay_s", "the weight digest of version 1"),
                                              ("load_delay_s", "update_weights_from_tensors")])
def test_a_phase_that_hangs_fails_naming_the_server_and_the_phase(setup, delay, phase, holds):
    s = setup("", "", request_timeout_s=0.5, weight_probe_every=0, weight_check_holds=holds)
    setattr(s.engines[1], delay, scaled(30))  # longer than the bound below, on any machine
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"inference server server-1: {phase} did not finish: waited 0.5 s "
                                           r"\(rollout.request_timeout_s\)"):
        s.update()
        assert (holds, delay) == ("training", "digest_delay_s")  # the check beside generation: the hand-out raises
        s.controller.wait(1, timeout=scaled(30))
    assert time.monotonic() - began < scaled(10)  # the request timeout (0.5 s), not the engine's hang


def test_the_trainer_digests_on_a_thread_of_its_own_while_the_engines_load(setup, monkeypatch):
    """The trainer's digests and the engines' load run at the same time: each waits for the other to have
    begun (they would time out one after the other otherwise), and the check still judges every update."""
    import asyncio
    import threading

    s = setup("", weight_probe_every=0)
    digest_began, load_began = threading.Event(), threading.Event()
    digests, load = s.handover._digests, s.engines[0].update_weights_from_tensors

    threads = []

    def digesting(version, weights):
        threads.append(threading.current_thread().name)
        digest_began.set()
        assert load_began.wait(10), "the engines' load did not begin while the trainer digested"
        return digests(version, weights)

    async def loading(named, version):
        load_began.set()
        assert await asyncio.to_thread(digest_began.wait, 10), "the trainer's digests did not begin beside the load"
        await load(named, version)

    monkeypatch.setattr(s.handover, "_digests", digesting)
    monkeypatch.setattr(s.engines[0], "update_weights_from_tensors", loading)
    s.update()
    s.handover.finish()  # the engines' digests are taken beside generation (weight_check_holds=training): their end
    assert digest_began.is_set() and load_began.is_set()
    assert s.engines[0].version == 1 and s.engines[0].digest_calls == 1 and s.controller.fleet.weight_failures == []
    assert threads and threads[0].startswith("areal-digest")


@pytest.mark.parametrize("holds", ["generation", "training"])
def test_trainer_digests_that_never_come_fail_the_update_naming_the_wait(setup, monkeypatch, holds):
    import threading

    s = setup("", request_timeout_s=0.5, weight_probe_every=0, weight_check_holds=holds)
    release = threading.Event()
    monkeypatch.setattr(s.handover, "_digests", lambda version, weights: release.wait(30))
    try:
        with pytest.raises(TimeoutError, match=r"the trainer's digests of the weights of version 1 did not come: "
                                               r"waited 0.5 s \(rollout.request_timeout_s\)"):
            s.update()
            assert holds == "training"
            s.controller.wait(1, timeout=scaled(30))
    finally:
        release.set()


def held_digest(engine, controller, monkeypatch):
    """``engine.weight_digest`` waits, once called, until the returned ``release`` is set; ``began`` is set when
    it is called, and ``paused`` records, when it answers, whether ``controller``'s admission (generation) was
    paused then."""
    import asyncio
    import threading

    began, release, paused = threading.Event(), threading.Event(), []
    digest = engine.weight_digest

    async def held(mode: str = "on") -> dict:
        began.set()
        assert await asyncio.to_thread(release.wait, scaled(30)), "the test never released the digest"
        answer = await digest(mode)
        paused.append(controller.admission._paused)
        return answer

    monkeypatch.setattr(engine, "weight_digest", held)
    return began, release, paused


@pytest.mark.parametrize("fault", ["", f"corrupt:{TENSOR}"])
def test_beside_generation_episodes_run_while_the_check_runs_and_none_is_handed_out_before_it_passed(
        setup, monkeypatch, fault):
    """rollout.weight_check_holds=training: the update returns with the engine's digest still held; a group
    generated before it is handed out meanwhile, an episode then runs to its end on the new version, and the
    hand-out of its group waits, saying why; once the digest answers, that group comes (healthy) or the hand-out
    and the next update raise naming the tensor, and the episode generated from the unchecked weights is never
    handed out (loader bug)."""
    s = setup("", fault, weight_probe_every=0, weight_check_holds="training")
    began, release, _ = held_digest(s.engines[1], s.controller, monkeypatch)
    s.controller.submit({"id": 6, "length": 3})
    wait_until(lambda: s.controller.stats()["ready"] == 1, 30, "the episode admitted before the update to end")
    try:
        s.update()  # returns although server-1's digest has not answered
        assert began.wait(scaled(10)) and not release.is_set()
        assert not s.controller.admission._paused  # generation resumed
        (before,) = s.controller.wait(1, timeout=scaled(5))  # all its tokens from version 0: not held
        assert {v for t in before.trajectories for v in t.versions if v >= 0} == {0}
        s.controller.submit({"id": 7, "length": 3})
        wait_until(lambda: s.controller.stats()["ready"] == 1, 30, "the episode admitted during the check to end")
        with pytest.raises(TimeoutError, match=r"the weights of version\(s\) \[1\] still being checked"):
            s.controller.wait(1, timeout=0.3)
        assert s.controller.stats()["consumed"] == 1
    finally:
        release.set()
    if not fault:
        (group,) = s.controller.wait(1, timeout=scaled(30))
        assert {v for t in group.trajectories for v in t.versions if v >= 0} == {1}
        s.update()
        s.handover.finish()
        assert [e.digest_calls for e in s.engines] == [2, 2] and s.controller.fleet.weight_failures == []
        return
    with pytest.raises(WeightCheckError, match=TENSOR) as error:
        s.controller.wait(1, timeout=scaled(30))
    assert "server-1" in str(error.value)
    assert s.controller.stats()["consumed"] == 1  # nothing generated since the update reached the trainer
    assert {m.name: m.state for m in s.controller.members()}["server-1"] == DOWN
    with pytest.raises(WeightCheckError, match=TENSOR):
        s.update()


@pytest.mark.parametrize(("holds", "rig"), [("generation", {}), ("training", {"weight_probe_every": 1}),
                                            ("training", {"elastic": True})],
                         ids=["holds-generation", "a-probe-update", "elastic"])
def test_these_updates_are_checked_before_generation_resumes(setup, monkeypatch, holds, rig):
    """weight_check_holds=generation, and whatever it says an update with the parity probe or an elastic fleet
    (a server dropped there is reloaded while the run goes on, so its tokens must not exist): the engine's
    digest answers while generation is still paused."""
    import threading

    s = setup("", "", weight_check_holds=holds, **{"weight_probe_every": 0, **rig})
    began, release, paused = held_digest(s.engines[0], s.controller, monkeypatch)
    update = threading.Thread(target=s.update)
    update.start()
    assert began.wait(scaled(10))
    update.join(0.5)
    assert update.is_alive(), "the update ended while an engine's digest had not answered"
    release.set()
    update.join(scaled(30))
    assert not update.is_alive() and paused == [True]
    assert s.engines[0].version == 1 and s.controller.fleet.weight_failures == []


def test_the_key_takes_on_sample_off_also_as_yaml_reads_them_and_names_the_fix_otherwise():
    from areal_core.config.load import load_config

    for given, expected in (("on", "on"), ("off", "off"), ("sample", "sample"), ("true", "on"), ("false", "off")):
        config, problems = load_config(None, [f"rollout.weight_check={given}"])
        assert problems == [] and config.rollout.weight_check == expected
    _, problems = load_config(None, ["rollout.weight_check=sometimes"])
    assert [(p.key, p.message, p.hint) for p in problems] == [
        ("rollout.weight_check", "'sometimes' is not allowed; choose one of: on, sample, off",
         "set rollout.weight_check=on")]


def test_the_run_log_says_what_the_gate_checks_and_names_a_backend_without_digests():
    from areal_core.trainer_weights import weight_check_line

    cfg = config()
    assert weight_check_line(cfg, [FaultyEngineDouble.__new__(FaultyEngineDouble)]) == (
        "weight check: digests of every tensor (on) after every update; the parity probe at the first update and "
        "every 10th")
    cfg.rollout.backend = "other"
    assert "no digests: rollout.backend 'other' does not declare 'weight_digest'" in weight_check_line(
        cfg, [LatencyEngineDouble()])
