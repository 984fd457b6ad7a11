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
    token_scale: int = field(default=1, metadata={
        "ge": 1, "help": "modelled tokens per token the engine returns (each returned token stands for this "
                         "many decode steps; prompts count len(input_ids) x this): what lets a simulated step "
                         "of millions of tokens pass through the real controller and trainer as thousands"})
    vocab_size: int = field(default=32000, metadata={"ge": 2, "help": "token ids are drawn below this"})


@dataclass
class _Request:
    request: GenerationRequest
    target: int  # tokens (records) it returns unless max_new_tokens or a pause cuts it
    future: asyncio.Future
    scale: int
    steps: int = 0  # modelled tokens generated so far (decode steps it took part in)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)

    @property
    def records(self) -> int:
        """Tokens it returns: ``target`` unless ``max_new_tokens`` is lower."""
        return min(self.target, self.request.sampling.max_new_tokens)

    @property
    def steps_left(self) -> int:
        return self.records * self.scale - self.steps

    @property
    def context(self) -> int:
        """Modelled tokens in its KV cache."""
        return len(self.request.input_ids) * self.scale + self.steps

    @property
    def reserved(self) -> int:
        """Modelled KV-cache tokens it holds at most: prompt + everything it may generate."""
        return (len(self.request.input_ids) + self.records) * self.scale

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
        self.scale = options.token_scale
        self._version = 0
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._paused = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._rng = random.Random()
        # the stretch of decode steps under way: when it began (loop time), its batch and mean context
        self._stretch: tuple[float, int, float, float] | None = None  # (began, batch, context, prefill_s)
        # modelled seconds spent working (decode steps, prefills, weight loads) and modelled tokens produced:
        # the simulator's utilisation figures
        self.busy_s = 0.0
        self.tokens = 0
        self.events = 0  # stretches planned: the simulator's own cost

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
        target = max(1, -(-self.profile.lengths.sample(rng) // self.scale))  # modelled length in whole tokens
        item = _Request(request, target, asyncio.get_running_loop().create_future(), self.scale)
        self._waiting.append(item)
        self._wake.set()
        return await item.future

    async def _sleep(self, modelled_s: float) -> None:
        self.busy_s += modelled_s
        await asyncio.sleep(modelled_s / self.time_scale)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _credit(self, now: float) -> None:
        """Give the running requests the decode steps of the current stretch that ended by ``now`` and close
        the stretch; the engine was busy for all of it (a step cut short by a pause is work thrown away)."""
        if self._stretch is None:
            return
        began, batch, context, prefill = self._stretch
        self._stretch = None
        table = self.profile.inference.decode_step_s
        most = min(r.steps_left for r in self._running) if self._running else 0
        elapsed = max(0.0, (now - began) * self.time_scale)
        done = table.steps_within(batch, context, max(0.0, elapsed - prefill), most)
        self.busy_s += min(elapsed, prefill + table.sum_steps(batch, context, most))
        for r in list(self._running):
            self._advance(r, done)

    def _advance(self, r: _Request, steps: int) -> None:
        """``steps`` more modelled tokens for ``r``: the returned tokens they complete, and its end."""
        r.steps += steps
        self.tokens += steps
        have, due = len(r.output_ids), min(r.steps // self.scale, r.records)
        if due > have:
            seed = r.request.sampling.seed
            for position in range(len(r.request.input_ids) + have, len(r.request.input_ids) + due):
                rng = random.Random(_mix(seed, position, 1)) if seed is not None else self._rng
                r.output_ids.append(rng.randrange(self.vocab_size))
                r.output_logprobs.append(-rng.expovariate(1.0))
            r.output_versions.extend([self._version] * (due - have))
        if r.steps_left <= 0:
            self._running.remove(r)
            limit = r.request.sampling.max_new_tokens
            r.finish("length" if len(r.output_ids) >= limit and r.target >= limit else "stop")

    async def _run(self) -> None:
        """Event-driven continuous batching: between two events (a request joins or finishes, a pause) the
        batch is fixed, so the whole stretch of decode steps is one wait (``DecodeTable.sum_steps``)."""
        assert self._wake is not None
        capacity = self.profile.inference.kv_capacity_tokens
        table = self.profile.inference.decode_step_s
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
            prefill = self.profile.inference.prefill_s(sum(len(r.request.input_ids) for r in joined) * self.scale)
            k = min(r.steps_left for r in self._running)
            self._stretch = (self._now(), batch, context, prefill)
            self.events += 1
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), (prefill + table.sum_steps(batch, context, k))
                                       / self.time_scale)
            except asyncio.TimeoutError:
                pass  # the stretch ran to its end: the first request to finish does
            if self._paused:  # pause() credited the steps done and answered every request
                continue
            if self._stretch is None:
                continue
            if self._wake.is_set() and self._waiting:
                # a request arrived: it joins at the end of the step in progress, which we wait out
                began, b, c, p = self._stretch
                elapsed = (self._now() - began) * self.time_scale - p
                done = table.steps_within(b, c, max(0.0, elapsed), k)
                boundary = p + table.sum_steps(b, c, min(done + 1, k))
                if boundary > elapsed + 1e-12 and done < k:
                    await asyncio.sleep((boundary - max(0.0, elapsed)) / self.time_scale)
                    if self._paused or self._stretch is None:
                        continue
            self._credit(self._now() + 1e-9 / self.time_scale)

    async def pause(self) -> None:
        """Every request in flight comes back now with the tokens it has and ``abort``; new ones wait."""
        self._credit(self._now())
        self._paused = True
        for r in self._running:
            r.finish("abort")
        self._running.clear()
        if self._wake is not None:
            self._wake.set()

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
