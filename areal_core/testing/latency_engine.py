"""A deterministic inference-engine test double for controller tests.

Latency per token is drawn from a seed and the request id, so a test is
repeatable; outputs always run to ``max_new_tokens`` (stop reason
``length``), which makes interrupted-and-continued requests end exactly where
uninterrupted ones would. ``pause`` makes every in-flight request return its
partial output with ``stop_reason="abort"`` before it returns, as real
engines must; an update while requests are still generating is an error, so
tests notice a controller that swaps weights outside the pause.
"""

from __future__ import annotations

import asyncio
import random
import zlib

from areal_core.api import GenerationResponse, InferenceEngine, Trajectory, Workflow


def token_for(rid: str, position: int) -> int:
    return zlib.crc32(f"{rid}:{position}".encode()) % 1000 + 10


class LatencyEngineDouble(InferenceEngine):
    capabilities = frozenset({"pause", "update_weights_from_disk"})

    def __init__(self, seed: int = 0, max_token_latency_s: float = 0.002) -> None:
        super().__init__()
        self.seed = seed
        self.max_token_latency_s = max_token_latency_s
        self._version = 0
        self._paused = False
        self._active = 0
        self.updates: list[tuple[str, int]] = []
        self.aborts = 0

    @property
    def version(self) -> int:
        return self._version

    async def agenerate(self, request):
        if self._paused:
            return GenerationResponse(request.rid, request.input_ids, [], [], [], "abort")
        rng = random.Random(f"{self.seed}:{request.rid}:{len(request.input_ids)}")
        self._active += 1
        out, logprobs, versions = [], [], []
        try:
            for _ in range(request.sampling.max_new_tokens):
                latency = rng.random() * self.max_token_latency_s
                await asyncio.sleep(latency)
                if self._paused:
                    self.aborts += 1
                    return GenerationResponse(request.rid, request.input_ids, out, logprobs, versions, "abort")
                out.append(token_for(request.rid, len(request.input_ids) + len(out)))
                logprobs.append(-0.5 - self._version)
                versions.append(self._version)
            return GenerationResponse(request.rid, request.input_ids, out, logprobs, versions, "length")
        finally:
            self._active -= 1

    async def pause(self):
        self._paused = True
        # on a timer, not sleep(0): a virtual clock's loop that always has work to run never moves time, so the
        # requests in flight would never wake to see the pause
        while self._active:
            await asyncio.sleep(0.001)

    async def resume(self):
        self._paused = False

    async def update_weights_from_disk(self, path, version):
        if self._active:
            raise RuntimeError(f"weights updated while {self._active} requests were generating")
        self.updates.append((path, version))
        self._version = version


class GroupWorkflowDouble(Workflow):
    """Samples ``group_size`` completions of ``item['length']`` tokens; reward from ``item['rewards']``."""

    def __init__(self, group_size: int = 2) -> None:
        super().__init__()
        self.group_size = group_size

    async def arun_episode(self, engine, item):
        from areal_core.api import GenerationRequest, SamplingParams

        if item.get("reject"):
            return None
        prompt = [1, 2, 3, item["id"] % 100]
        requests = [GenerationRequest(prompt, SamplingParams(max_new_tokens=item["length"]), rid=f"{item['id']}-{i}")
                    for i in range(self.group_size)]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        rewards = item.get("rewards") or [0.0] * self.group_size
        return [
            Trajectory(tokens=prompt + r.output_ids, loss_mask=[0] * len(prompt) + [1] * len(r.output_ids),
                       logprobs=[0.0] * len(prompt) + r.output_logprobs,
                       versions=[-1] * len(prompt) + r.output_versions, reward=rewards[i],
                       info={"rid": r.rid, "stop_reason": r.stop_reason})
            for i, r in enumerate(responses)
        ]


def items(n: int, seed: int = 0, max_length: int = 8, **extra):
    rng = random.Random(seed)
    return [{"id": i, "length": rng.randint(1, max_length), **extra} for i in range(n)]
