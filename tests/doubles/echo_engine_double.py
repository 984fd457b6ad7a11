"""Inference engine test doubles for the conformance kit's own tests.

``EchoInferenceEngineDouble`` honours the whole contract without a model:
greedy decoding echoes the prompt's ids, sampling draws ids from a seeded
RNG, one token every ``token_delay_s``. The other doubles each break one
rule, to show the kit fails them. Installed as a fake distribution by
``tests/test_conformance_kit.py``; never shipped.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from areal_core.api import GenerationRequest, GenerationResponse, InferenceEngine

VOCAB = 1000


@dataclass
class EchoEngineDoubleConfig:
    token_delay_s: float = field(default=0.002, metadata={"help": "seconds per generated token"})


class EchoInferenceEngineDouble(InferenceEngine):
    config_class = EchoEngineDoubleConfig
    capabilities = frozenset({"pause", "seed", "update_weights_from_disk", "weight_digest"})

    def __init__(self, context=None) -> None:
        super().__init__(context)
        options = self.context.options or EchoEngineDoubleConfig()
        self.token_delay_s = options.token_delay_s
        self._version = 0
        self._paused = False
        self._resumed: asyncio.Event | None = None
        self._in_flight = 0
        self.closed = 0
        self.held: dict = {}  # the tensors of the last folder loaded (its *.safetensors files), for weight_digest

    @property
    def version(self) -> int:
        return self._version

    def _resumed_event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        await self._resumed_event().wait()
        sampling = request.sampling
        rng = random.Random(sampling.seed)
        out: list[int] = []
        logprobs: list[float] = []
        reason = "length"
        self._in_flight += 1
        try:
            while len(out) < sampling.max_new_tokens:
                await asyncio.sleep(self.token_delay_s)
                if self._paused:
                    reason = "abort"
                    break
                if sampling.temperature == 0:
                    token, logprob = request.input_ids[len(out) % len(request.input_ids)], -0.25
                else:
                    token, logprob = rng.randrange(VOCAB), -math.log(VOCAB)
                out.append(token)
                logprobs.append(logprob)
                if token in sampling.stop_token_ids:
                    reason = "stop"
                    break
        finally:
            self._in_flight -= 1
        return self.respond(request, out, logprobs, reason)

    def respond(self, request: GenerationRequest, out: list[int], logprobs: list[float],
                reason: str) -> GenerationResponse:
        return GenerationResponse(request.rid, list(request.input_ids), out, logprobs,
                                  [self._version] * len(out), reason)

    async def pause(self) -> None:
        self._paused = True
        self._resumed_event().clear()
        while self._in_flight:
            await asyncio.sleep(self.token_delay_s)

    async def resume(self) -> None:
        self._paused = False
        self._resumed_event().set()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        if not Path(path).exists():
            raise FileNotFoundError(f"no weights at {path}")
        from safetensors.torch import load_file

        self.held = {name: t for file in sorted(Path(path).glob("*.safetensors")) for name, t in
                     load_file(str(file)).items()}
        self._version = version

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        from areal_core.weight_check import digest_named

        return digest_named(self.held.items(), mode)

    async def aclose(self) -> None:
        self.closed += 1


class ShortLogprobsEngineDouble(EchoInferenceEngineDouble):
    """Broken: drops the last logprob (the contract's dataclass refuses the response)."""

    def respond(self, request, out, logprobs, reason):
        return super().respond(request, out, logprobs[:-1], reason)


class PositiveLogprobsEngineDouble(EchoInferenceEngineDouble):
    """Broken: returns probabilities where logprobs belong."""

    def respond(self, request, out, logprobs, reason):
        return super().respond(request, out, [math.exp(lp) for lp in logprobs], reason)


class IgnoresPauseEngineDouble(EchoInferenceEngineDouble):
    """Broken: claims 'pause' but keeps decoding through it."""

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None


class WaitingPauseEngineDouble(EchoInferenceEngineDouble):
    """Broken: pause() waits for the requests in flight to finish instead of aborting them (vLLM's mode
    'wait'), so the pause test never sees a request still running when the pause took effect."""

    async def pause(self) -> None:
        self._resumed_event().clear()
        while self._in_flight:
            await asyncio.sleep(self.token_delay_s)
        self._paused = True


class StaleVersionEngineDouble(EchoInferenceEngineDouble):
    """Broken: reports the new version after an update but tags tokens with the first one."""

    def respond(self, request, out, logprobs, reason):
        return GenerationResponse(request.rid, list(request.input_ids), out, logprobs, [0] * len(out), reason)


class PermutingLoaderEngineDouble(EchoInferenceEngineDouble):
    """Broken: its loader reverses the rows of every matrix it loads (a layout bug); its digests tell."""

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await super().update_weights_from_disk(path, version)
        self.held = {name: t.flip(0) if t.dim() > 1 else t for name, t in self.held.items()}


class PausingDigestEngineDouble(EchoInferenceEngineDouble):
    """Broken: it pauses to hash what it holds (the requests in flight come back aborted), which a controller
    checking beside generation (rollout.weight_check_holds: training) turns into interrupted rollouts."""

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        await self.pause()
        try:
            return await super().weight_digest(mode)
        finally:
            await self.resume()


class MisspeltCapabilityEngineDouble(EchoInferenceEngineDouble):
    """Broken: a typo in capabilities would silently skip the pause tests."""

    capabilities = frozenset({"puase", "seed", "update_weights_from_disk"})
