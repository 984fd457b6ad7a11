"""The simulated inference engine: the real contract, modelled time instead of a model.

It batches continuously, as vLLM and SGLang do: requests join the running
batch at the next decode step while the KV cache has room for them
(``inference.kv_capacity_tokens``: a request reserves its prompt plus the
tokens it may still generate), every step gives each running request one
token, and a step lasts what the profile says for that batch and mean
context, plus the prefill of the requests that joined. Response lengths come
from the profile's distribution (seeded requests draw theirs from the seed),
so a batch has stragglers as real reasoning traces do. ``pause()`` returns
every request in flight with the tokens it has and ``stop_reason="abort"``;
weight updates take the profile's transfer time and set the version every
later token carries.

Time passes through ``asyncio.sleep`` on the engine's event loop, divided by
``time_scale``: under a loop whose clock is virtual, modelled seconds cost
no wall time, and nothing here changes. Token ids and logprobs are random
(seeded requests are reproducible, position by position, so a continued
request draws what the uninterrupted one would have): nothing downstream may
read meaning into them.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Iterable

from areal_core.api import GenerationRequest, GenerationResponse, InferenceEngine

from areal_sim.profile import load_profile


@dataclass
class SimEngineConfig:
    """Keys of ``rollout`` when ``rollout.backend: sim``."""

    profile: str = field(default="qwen2.5-7b-h800", metadata={
        "help": "a shipped latency profile (areal_sim/profiles) or the path of a profile YAML"})
    time_scale: float = field(default=1.0, metadata={
        "gt": 0.0, "help": "modelled seconds per wall-clock second on a real clock (1 = the modelled hardware's "
                           "speed; a virtual clock makes it irrelevant)"})
    vocab_size: int = field(default=32000, metadata={"ge": 2, "help": "token ids are drawn below this"})


@dataclass
class _Request:
    request: GenerationRequest
    target: int  # tokens it generates unless max_new_tokens or a pause cuts it
    future: asyncio.Future
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)

    @property
    def context(self) -> int:
        return len(self.request.input_ids) + len(self.output_ids)

    @property
    def reserved(self) -> int:
        """KV-cache tokens it holds at most: prompt + everything it may generate."""
        return len(self.request.input_ids) + min(self.target, self.request.sampling.max_new_tokens)

    def finish(self, stop_reason: str) -> None:
        if not self.future.done():
            self.future.set_result(GenerationResponse(
                self.request.rid, list(self.request.input_ids), self.output_ids, self.output_logprobs,
                self.output_versions, stop_reason))


def _mix(*parts: int) -> int:
    """A 64-bit hash of integers (SplitMix64's finaliser), for per-position random draws."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


class SimInferenceEngine(InferenceEngine):
    capabilities = frozenset({"pause", "seed", "update_weights_from_disk", "update_weights_from_tensors"})
    config_class = SimEngineConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        options = self.context.options or SimEngineConfig()
        self.profile = load_profile(options.profile)
        self.time_scale, self.vocab_size = options.time_scale, options.vocab_size
        self._version = 0
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._paused = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._rng = random.Random()
        # modelled seconds spent working (decode steps, prefills, weight loads) and tokens produced: the
        # simulator's utilisation figures
        self.busy_s = 0.0
        self.tokens = 0

    @property
    def version(self) -> int:
        return self._version

    def describe(self) -> str:
        return f"simulated engine ({self.profile.name})"

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-inference")

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        await self.start()
        assert self._wake is not None
        seed = request.sampling.seed
        rng = random.Random(_mix(seed, len(request.input_ids))) if seed is not None else self._rng
        item = _Request(request, self.profile.lengths.sample(rng), asyncio.get_running_loop().create_future())
        self._waiting.append(item)
        self._wake.set()
        return await item.future

    async def _sleep(self, modelled_s: float) -> None:
        self.busy_s += modelled_s
        await asyncio.sleep(modelled_s / self.time_scale)

    async def _run(self) -> None:
        assert self._wake is not None
        capacity = self.profile.inference.kv_capacity_tokens
        while True:
            if self._paused or not (self._waiting or self._running):
                self._wake.clear()
                await self._wake.wait()
                continue
            used = sum(r.reserved for r in self._running)
            joined = []
            while self._waiting and (not self._running and not joined or used + self._waiting[0].reserved <= capacity):
                item = self._waiting.pop(0)
                used += item.reserved
                joined.append(item)
            self._running.extend(joined)
            batch = len(self._running)
            context = sum(r.context for r in self._running) / batch
            step = self.profile.inference.decode_step_s(batch, context) + \
                self.profile.inference.prefill_s(sum(len(r.request.input_ids) for r in joined))
            await self._sleep(step)
            if self._paused:  # pause() answered every request of this step with what it had before it
                continue
            for r in list(self._running):
                self._emit(r)

    def _emit(self, r: _Request) -> None:
        position = r.context
        seed = r.request.sampling.seed
        rng = random.Random(_mix(seed, position, 1)) if seed is not None else self._rng
        r.output_ids.append(rng.randrange(self.vocab_size))
        r.output_logprobs.append(-rng.expovariate(1.0))
        r.output_versions.append(self._version)
        self.tokens += 1
        limit = r.request.sampling.max_new_tokens
        if len(r.output_ids) >= min(r.target, limit):
            self._running.remove(r)
            r.finish("length" if len(r.output_ids) >= limit and r.target >= limit else "stop")

    async def pause(self) -> None:
        """Every request in flight comes back now with the tokens it has and ``abort``; new ones wait."""
        self._paused = True
        for r in self._running:
            r.finish("abort")
        self._running.clear()

    async def resume(self) -> None:
        self._paused = False
        if self._wake is not None:
            self._wake.set()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._sleep(self.profile.weights.transfer_s())
        self._version = version

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        await self._sleep(self.profile.weights.transfer_s())
        self._version = version

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for r in self._running + self._waiting:
            r.finish("abort")
        self._running.clear()
        self._waiting.clear()
