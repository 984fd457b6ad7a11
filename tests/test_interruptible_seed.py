"""A continued request keeps its seed, so an engine that keys seeded draws by token position continues the stream.

The contract areal_core.rollout.interruptible documents and the embedded engine relies on: after an
interruption the facade re-submits prompt + output so far with the remaining budget and the request's own
seed, rid and metadata, so each new token sits at its uninterrupted position.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from areal_core.api import stable_seed
from areal_core.api.inference import GenerationRequest, GenerationResponse, InferenceEngine, SamplingParams
from areal_core.rollout import InterruptibleEngine


class PositionKeyedEngineDouble(InferenceEngine):
    """Samples the token at sequence position p of a request seeded s from (s, p) alone, as the embedded engine
    does. With ``cut``, a request's first call stops after ``cut`` tokens with ``abort`` and the version moves
    on, as a weight update would make it."""

    def __init__(self, cut: int | None = None) -> None:
        super().__init__()
        self.cut = cut
        self._version = 0
        self.requests: list[GenerationRequest] = []

    @property
    def version(self) -> int:
        return self._version

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        self.requests.append(request)
        s = request.sampling
        interrupt = self.cut is not None and len(self.requests) == 1
        n = min(self.cut, s.max_new_tokens) if interrupt else s.max_new_tokens
        start = len(request.input_ids)
        out = [stable_seed("draw", s.seed, start + i) % 1000 for i in range(n)]
        response = GenerationResponse(request.rid, list(request.input_ids), out, [-1.0] * n, [self._version] * n,
                                      "abort" if interrupt else "length")
        if interrupt:
            self._version += 1
        return response


def test_a_continuation_keeps_the_seed_so_a_position_keyed_engine_samples_the_uninterrupted_tokens():
    prompt, n, k = [11, 12, 13], 10, 4
    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=n, temperature=1.0, seed=42), rid="r",
                                metadata={"item_id": "a", "sample": 0})

    async def main():
        reference = await PositionKeyedEngineDouble().agenerate(request)
        engine = PositionKeyedEngineDouble(cut=k)
        return reference, engine, await InterruptibleEngine([engine]).agenerate(request)

    reference, engine, response = asyncio.run(main())
    assert response.output_ids == reference.output_ids and response.stop_reason == "length"
    assert response.output_versions == [0] * k + [1] * (n - k)
    first, second = engine.requests
    assert first.sampling == request.sampling and first.input_ids == prompt
    # The continuation: prompt + output so far, the remaining budget, and nothing else changed (the seed above all).
    assert second.input_ids == prompt + reference.output_ids[:k]
    assert second.sampling == replace(request.sampling, max_new_tokens=n - k)
    assert (second.rid, second.metadata) == (request.rid, request.metadata)
