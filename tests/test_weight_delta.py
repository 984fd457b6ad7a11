"""Delta weight updates (``rollout.weight_delta``, :mod:`areal_core.weight_delta`): the codec, and the hand-over
through the real controller to engine doubles (tests/doubles/weight_engine_doubles.py)."""

from __future__ import annotations

import pytest
import torch

from areal_core.weight_delta import WeightDelta, apply_delta, delta_from_named, delta_to_named, make_delta


def bf16_steps(steps: int, seed: int = 0):
    """Weights of a few shapes in bf16 after each of ``steps`` Adam-like steps: most bits stay, some move."""
    generator = torch.Generator().manual_seed(seed)
    master = {"a": torch.randn(64, 48, generator=generator), "b": torch.randn(300, generator=generator),
              "c": torch.randn(7, 5, 3, generator=generator), "n": torch.randn(2, generator=generator)}
    versions = []
    for step in range(steps + 1):
        versions.append([(k, v.to(torch.bfloat16)) for k, v in master.items()])
        for k, v in master.items():
            scale = 1.0 if k == "n" else 2e-4  # "n" changes everywhere: it goes whole
            v.add_(torch.randn(v.shape, generator=generator) * scale * v.abs())
    return versions


def bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_deltas_equal_full_updates_bit_for_bit_after_20_random_steps():
    versions = bf16_steps(20)
    held = {k: v.clone() for k, v in versions[0]}
    sent = full = 0
    for v in range(1, 21):
        delta = make_delta(dict(versions[v - 1]), versions[v], v - 1, v)
        again = delta_from_named(dict(delta_to_named(delta)), v - 1, v)  # through the named form a transport carries
        apply_delta(held, again)
        assert all(bits_equal(held[k], t) for k, t in versions[v]), f"version {v} differs after its delta"
        assert "n" in [name for name, _ in delta.full] and delta.sparse
        sent, full = sent + delta.nbytes, full + delta.full_nbytes
    assert sent < full / 3, (sent, full)


def test_a_delta_that_does_not_fit_is_refused_whole_and_changes_nothing():
    versions = bf16_steps(1)
    delta = make_delta(dict(versions[0]), versions[1], 0, 1)
    held = {k: v.clone() for k, v in versions[0]}
    held["b"] = held["b"].float()
    before = {k: v.clone() for k, v in held.items()}
    with pytest.raises(ValueError, match=r"delta 0 -> 1 refused, nothing applied: 'b': sent torch.bfloat16 elements, "
                                         r"held torch.float32"):
        apply_delta(held, delta)
    assert all(torch.equal(before[k], held[k]) for k in held)


def test_new_names_shapes_and_empty_tensors_go_whole():
    base = {"a": torch.zeros(4), "b": torch.zeros(3)}
    delta = make_delta(base, [("a", torch.zeros(5)), ("b", torch.zeros(3)), ("z", torch.ones(2)),
                              ("e", torch.zeros(0))], 3, 4)
    assert [n for n, _ in delta.full] == ["a", "z", "e"] and delta.sparse == []  # b did not change: not sent
    assert isinstance(delta, WeightDelta) and delta.full_nbytes == 4 * (5 + 3 + 2)


# ------------------------------------------------------------------ through the real hand-over
TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from areal_core.testing import tiny_model

    return str(tiny_model(tmp_path_factory.mktemp("delta") / "model", seed=0))


@pytest.fixture
def rig(model, tmp_path):
    from weight_engine_doubles import HandOverRig

    made = []

    def make(*faults, dtype=torch.bfloat16, **kwargs):
        made.append(HandOverRig(model, tmp_path, list(faults), dtype=dtype, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def held_bits_equal_sent(engine, actor) -> bool:
    sent = {name: t for bucket in actor.export_tensors(0) for name, t in bucket}
    own = engine.held.state_dict()
    return all(bits_equal(own[name], t) for name, t in sent.items())


def test_deltas_through_the_hand_over_equal_full_updates_bit_for_bit_and_send_far_fewer_bytes(rig):
    r = rig("", "")
    for _ in range(20):
        r.update(scale=2e-4)
        assert all(held_bits_equal_sent(e, r.actor) for e in r.engines)  # and the gate (digests, probes) passed
    assert [e.deltas for e in r.engines] == [19, 19]  # the first update has no base: full
    fleet = r.controller.fleet
    assert fleet.full_bytes == 0
    sent = sum(t.numel() * t.element_size() for _, t in r.handover._base[1].items())
    assert 0 < fleet.delta_bytes / 2 < sent / 5, (fleet.delta_bytes, sent)  # per engine, 5x fewer at least


def test_a_delta_against_the_wrong_base_is_refused_and_a_full_update_follows(rig):
    r = rig("", "", weight_probe_every=0)
    r.update(scale=2e-4)
    r.engines[1].claims_version = 1
    r.engines[1]._version = 0  # it holds another version than its client believes: it refuses the delta
    r.update(scale=2e-4)
    assert [e.deltas for e in r.engines] == [1, 0] and [e.version for e in r.engines] == [2, 2]
    assert r.controller.fleet.full_bytes > 0 and held_bits_equal_sent(r.engines[1], r.actor)


def test_the_integrity_gate_covers_deltas(rig):
    from areal_core.weight_check import WeightCheckError

    r = rig("", f"drop:{TENSOR}", weight_probe_every=0)
    r.update(scale=2e-4)  # full: nothing to drop
    with pytest.raises(WeightCheckError, match=f"server-1 does not serve the weights of version 2.*{TENSOR}"):
        r.update(scale=2e-4)
        r.handover.finish()  # the check runs beside generation (weight_check_holds: training): the trainer's wait


def test_with_deltas_off_every_update_is_full(rig):
    r = rig("", weight_delta="off", weight_probe_every=0)
    for _ in range(2):
        r.update(scale=2e-4)
    assert r.engines[0].deltas == 0 and r.controller.fleet.delta_bytes == 0


def test_float32_weights_that_change_everywhere_go_whole_without_a_full_compare_and_no_delta_is_sent(rig):
    base = {"w": torch.randn(1000, 100)}
    new = [("w", base["w"] * (1 + 1e-4))]  # every element's bits move, as float32 weights under Adam
    delta = make_delta(base, new, 0, 1)
    assert [n for n, _ in delta.full] == ["w"] and delta.nbytes == delta.full_nbytes
    r = rig("", dtype=torch.float32, weight_probe_every=0)
    for _ in range(3):
        r.update(scale=1e-3)
    assert r.engines[0].deltas == 0 and r.controller.fleet.full_bytes > 0  # too large a delta: the full path
