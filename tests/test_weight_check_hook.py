"""The integrity gate's backend hook (``InferenceEngine.sent_digests``): the trainer's real hand-over
(:class:`~areal_core.trainer_weights.WeightHandOver`) digests what it sends with the routed engines' own function
when their backend gives one (a server that hashes only its own layout, as SGLang's ``/weights_checker``), and
with the trainer's names and hash (``digest_weights``) otherwise. Engines: the doubles of
tests/doubles/weight_engine_doubles.py, here reporting their digests under a layout of their own."""

from __future__ import annotations

import hashlib

import pytest

from areal_core.api import InferenceEngine
from areal_core.testing import tiny_model
from areal_core.weight_check import WeightCheckError, digest_named, digest_weights
from weight_engine_doubles import HandOverRig

TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("weights") / "model", seed=0))


def own_layout(named) -> dict[str, str]:
    """A server's own digest (test double of one): its own names (``@own``) and hash (SHA-256 of the bytes)."""
    import torch

    return {f"{name}@own": hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()[:16]
            for name, t in named}


def in_own_layout(rig: HandOverRig) -> None:
    """Every engine of ``rig`` reports its digests in :func:`own_layout`, and gives the trainer the function."""
    for engine in rig.engines:
        async def weight_digest(mode: str = "on", engine=engine) -> dict[str, str]:
            return own_layout(engine.held.state_dict().items())  # what its (faulty) loader holds

        engine.weight_digest = weight_digest
        engine.sent_digests = lambda weights, mode="on": own_layout(weights)


def test_the_default_is_the_trainers_names_and_hash():
    import torch

    named = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    assert InferenceEngine.sent_digests(None, named, "on") == digest_named(named) == digest_weights(named)


def test_the_hand_over_uses_the_engines_digest_function_and_a_good_load_passes(model, tmp_path):
    rig = HandOverRig(model, tmp_path, ["", ""])
    try:
        in_own_layout(rig)
        rig.update()
        sent = rig.controller.fleet.sent_digests
        assert sent is not None and sent.digests and all(name.endswith("@own") for name in sent.digests)
        assert rig.controller.fleet.weight_failures == []
    finally:
        rig.close()


def test_a_layout_bug_is_caught_in_the_engines_own_names(model, tmp_path):
    rig = HandOverRig(model, tmp_path, ["", f"permute:{TENSOR}"])
    try:
        in_own_layout(rig)
        with pytest.raises(WeightCheckError) as failed:
            rig.update()
    finally:
        rig.close()
    assert failed.value.engine == "server-1"
    assert [d.split(":")[0] for d in failed.value.differences] == [f"{TENSOR}@own"]
