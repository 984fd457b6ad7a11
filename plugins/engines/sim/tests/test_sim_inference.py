"""The simulated inference engine keeps the real contract (the conformance kit) and spends the profile's time."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams
from areal_core.testing import InferenceEngineConformance
from areal_sim.inference import SimEngineConfig, SimInferenceEngine
from areal_sim.profile import Lengths


class TestSimInferenceConformance(InferenceEngineConformance):
    component_name = "sim"
    long_max_new_tokens = 512

    def make(self, cls):
        # 7B on H800 at 40x: a 512-token generation takes ~0.14 s of wall time
        return cls.create(Context(options=SimEngineConfig(time_scale=40.0)))

    def weights_path_for_update(self) -> str:
        return "/the/sim/engine/reads/no/weights"


def _run(body, **options):
    async def main():
        engine = SimInferenceEngine(Context(options=SimEngineConfig(**options)))
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.aclose()

    return asyncio.run(main())


def test_a_lone_request_takes_the_profiles_decode_time():
    async def body(engine):
        began = time.monotonic()
        r = await engine.agenerate(GenerationRequest([1] * 100, SamplingParams(max_new_tokens=200, seed=3)))
        return r, time.monotonic() - began, engine

    r, wall, engine = _run(body, time_scale=20.0)
    step = engine.profile.inference.decode_step_s
    expected = sum(step(1, 100 + i) for i in range(len(r.output_ids))) + engine.profile.inference.prefill_s(100)
    assert engine.busy_s == pytest.approx(expected, rel=1e-9)
    assert wall >= 0.9 * expected / 20.0  # the modelled time is spent (at 20x); asyncio adds its own on top


def test_batching_is_cheaper_per_token_than_one_at_a_time_and_lengths_are_long_tailed():
    async def body(engine):
        # the profile's distribution at a smaller scale (median 200, cap 4000) keeps the test short
        object.__setattr__(engine.profile, "lengths", Lengths(median=200, sigma=1.0, cap=4000, prompt=50))
        requests = [GenerationRequest([1] * 50, SamplingParams(max_new_tokens=4000, seed=s)) for s in range(64)]
        return await asyncio.gather(*(engine.agenerate(r) for r in requests)), engine

    out, engine = _run(body, time_scale=1e6)
    lengths = sorted(len(r.output_ids) for r in out)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # stragglers
    alone = sum(engine.profile.inference.decode_step_s(1, 50 + i) for n in lengths for i in range(n))
    assert engine.busy_s < alone / 5  # the stragglers finish at small batches, so well short of 64x
    assert {r.stop_reason for r in out} <= {"stop", "length"}


def test_requests_wait_for_room_in_the_kv_cache():
    async def body(engine):
        object.__setattr__(engine.profile.inference, "kv_capacity_tokens", 1000)
        requests = [GenerationRequest([1] * 400, SamplingParams(max_new_tokens=100, seed=s)) for s in range(4)]
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in requests]
        await asyncio.sleep(0)
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, len(engine._running))
            await asyncio.sleep(0.0005)
        return peak

    assert _run(body, time_scale=50.0) == 2  # 2 x (400 + 100) fit in 1000 tokens, a third does not
