"""The simulated inference engine: the real contract, modelled time instead of a model.

It batches continuously, as vLLM and SGLang do: every step gives each running
request one token, and a step lasts what the profile says for that batch and
mean context, plus the prefill of the requests that joined. The KV cache
(``inference.kv_capacity_tokens``) is managed as vLLM's scheduler does,
without knowing how long a request will be: a request holds its context (its
prompt and the tokens it has so far) and grows by a token a step; a waiting
request joins when its context and every running request's next token fit;
when the running requests' next tokens no longer fit, the request that joined
last is preempted: it gives its cache back, waits at the head of the queue,
and when it joins again its whole context is prefilled again (recompute).
:attr:`SimInferenceEngine.preempted` and ``recomputed_tokens`` count them. Response lengths come
from the profile's distribution (seeded requests draw theirs from the seed),
so a batch has stragglers as real reasoning traces do. ``pause()`` returns
every request in flight with the tokens it has and ``stop_reason="abort"``;
weight updates take the profile's transfer time and set the version every
later token carries. A request continued after a pause (the same ``rid``, its
prompt grown by the tokens it had) keeps the length it drew first, on
whichever simulated server it continues: interruption changes when tokens
come, never how many, so interruptible and drained runs compare like with like.

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
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from areal_core.api import GenerationRequest, GenerationResponse, InferenceEngine, stable_seed

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
    threads: int = field(default=0, metadata={
        "ge": 0, "help": "threads of this server, for a profile of roles that share a CPU (its cpu section): "
                         "times scale by the profile's measured speedup; 0 = one (areal simulate sets it from "
                         "the local launcher's thread plan)"})
    contended: bool = field(default=False, metadata={
        "help": "the other role runs at once on the same CPU: times scale by the profile's cpu.contention "
                "(areal simulate sets it at eta > 0)"})
    step_cpu_s: float = field(default=-1.0, metadata={
        "help": "the serving engine's CPU-side seconds per decode step (scheduling, sampling), in place of the "
                "profile's inference.step_cpu_s; negative: the profile's (areal simulate: sim.step_cpu_ms)"})
    colocated: bool = field(default=False, metadata={
        "help": "the servers share their GPUs with the trainer (generation and training in turns): a weight update "
                "is a reload in place, the trainer's shards gathered over the node's NVLink (the profile's "
                "train.tp_link_gbps; weights.link_gbps without it), not a transfer between machines"})
    interruptible: bool = field(default=True, metadata={
        "help": "false: the engine cannot pause, so a weight update waits for the requests in flight to finish "
                "(drain-on-update, the baseline interruptible generation is measured against)"})


@dataclass(eq=False)
class _Request:
    request: GenerationRequest
    target: int  # tokens it returns unless max_new_tokens or a pause cuts it
    future: asyncio.Future
    scale: int
    origin: tuple[int, int] = (0, 0)  # (the length it drew at its first call, that call's prompt length)
    joined: int = 0  # the engine's step count when it (last) joined the batch
    end: int = 0  # the engine's step count at which it has every token
    base: int = 0  # modelled tokens it produced before it was preempted (0: never preempted)
    entry: int = 0  # its live entry in the engine's heap of ends (older entries are stale)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        self.records = min(self.target, self.request.sampling.max_new_tokens)  # tokens it returns at most
        self.prompt = len(self.request.input_ids) * self.scale  # modelled prompt tokens

    @property
    def context(self) -> int:
        """Modelled tokens in its KV cache when it (re)joins: prompt and what it produced before."""
        return self.prompt + self.base

    def finish(self, stop_reason: str) -> None:
        self.done = True
        if not self.future.done():
            self.future.set_result(GenerationResponse(
                self.request.rid, list(self.request.input_ids), self.output_ids, self.output_logprobs,
                self.output_versions, stop_reason))


POOL = 1 << 12  # random tokens drawn per engine, handed out as slices to unseeded requests

# rid -> (the length a request drew at its first call, that call's prompt length), for requests answered with
# "abort" and not yet continued. Shared by every simulated server of the process, because a continuation may go
# to another server (elastic pools move requests); bounded, since a run may end with requests never continued.
_interrupted: dict[str, tuple[int, int]] = {}
MAX_INTERRUPTED = 1 << 20


_pools: dict[tuple[int, int], tuple[list[int], list[float]]] = {}


def _pool(seed: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """The random tokens and logprobs unseeded requests take slices of: drawn once per run seed and vocabulary and
    shared by every simulated server of the process (each starts its slices where its own generator says;
    drawing a pool per server took seconds at hundreds of servers)."""
    pool = _pools.get((seed, vocab_size))
    if pool is None:
        rng = random.Random(stable_seed("sim-pool", seed, vocab_size))
        pool = _pools[(seed, vocab_size)] = ([rng.randrange(vocab_size) for _ in range(POOL)],
                                             [-rng.expovariate(1.0) for _ in range(POOL)])
    return pool


def _remember(r: _Request) -> None:
    """``r`` is answered with ``abort``: its continuation, wherever it goes, keeps the length ``r`` drew."""
    if len(_interrupted) >= MAX_INTERRUPTED:
        del _interrupted[next(iter(_interrupted))]
    _interrupted[r.request.rid] = r.origin


def _cycle(pool: list, start: int, n: int) -> list:
    """``n`` items of ``pool`` from ``start``, wrapping around."""
    if start + n <= len(pool):
        return pool[start:start + n]
    out = pool[start:]
    while len(out) < n:
        out.extend(pool[: n - len(out)])
    return out


def _finish(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
        profile = load_profile(options.profile)
        if options.step_cpu_s >= 0:
            profile = profile.with_step_cpu(options.step_cpu_s)
        self.profile = profile.on_threads(max(options.threads, 1), 1, options.contended)
        self.time_scale, self.vocab_size = options.time_scale, options.vocab_size
        self.scale = options.token_scale
        self.colocated = options.colocated
        if not options.interruptible:
            self.capabilities = type(self).capabilities - {"pause"}
        self._version = 0
        self._waiting: deque[_Request] = deque()
        # The running batch. Every running request gains a token per decode step, so the engine counts steps
        # (``_steps``) and each request only remembers when it joined and when it ends: a heap of ends gives the
        # next finish and running sums give the batch's KV use and mean context, O(log n) per event.
        self._running: dict[_Request, None] = {}  # insertion-ordered (a set's order would vary run to run)
        self._ends: list[tuple[int, int, _Request]] = []  # (end, entry, request); finished / preempted linger
        self._steps = 0
        self._order = 0
        self._sum_context = 0  # modelled tokens the running requests had when they joined
        self._sum_joined = 0  # their join steps: KV-cache tokens in use = sum_context + n * steps - sum_joined
        self._paused = False
        self._kicked = False  # a request arrived, or pause / resume, since the engine last looked
        self._waiter: asyncio.Future | None = None  # what the engine awaits: a kick, or its stretch's end
        self._task: asyncio.Task | None = None
        # unseeded requests draw from the engine's own generator, seeded by the run's seed and the server's
        # index: a simulation is reproducible
        config, index = self.context.config, self.context.extras.get("server_index", 0)
        self._rng = random.Random(stable_seed("sim-engine", int(config.trainer.seed) if config is not None else 0,
                                              index))
        self._pool_ids, self._pool_logprobs = _pool(int(config.trainer.seed) if config is not None else 0,
                                                    self.vocab_size)
        # the stretch of decode steps under way: when it began (loop time), its batch and mean context
        # (began, batch, context, prefill_s, modelled seconds to its planned end)
        self._stretch: tuple[float, int, float, float, float] | None = None
        # modelled seconds spent working (decode steps, prefills, weight loads) and modelled tokens produced:
        # the simulator's utilisation figures
        self.busy_s = 0.0
        self.tokens = 0
        self.events = 0  # stretches planned: the simulator's own cost
        self.requests = 0  # generation calls answered (an interrupted request continues as a new call)
        self.aborted = 0  # of them, answered with abort by a pause
        self.preempted = 0  # times a running request gave its cache back because the next tokens did not fit
        self.recomputed_tokens = 0  # modelled tokens prefilled again when preempted requests rejoined

    @property
    def version(self) -> int:
        return self._version

    def describe(self) -> str:
        return f"simulated engine ({self.profile.name})"

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-inference")

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        if self._task is None:
            await self.start()
        self.requests += 1
        origin = _interrupted.pop(request.rid, None)
        if origin is not None and len(request.input_ids) >= origin[1]:  # a continuation: what is left of it
            target = max(1, origin[0] - (len(request.input_ids) - origin[1]))
        else:
            seed = request.sampling.seed
            rng = random.Random(_mix(seed, len(request.input_ids))) if seed is not None else self._rng
            target = max(1, -(-self.profile.lengths.sample(rng) // self.scale))  # modelled length in whole tokens
            origin = (target, len(request.input_ids))
        item = _Request(request, target, asyncio.get_running_loop().create_future(), self.scale, origin)
        self._waiting.append(item)
        self._kick()
        return await item.future

    def _kick(self) -> None:
        self._kicked = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, modelled_s: float | None) -> bool:
        """Until kicked, or ``modelled_s`` have passed (None: no limit); True when kicked. A future and a timer
        of the loop's own, not ``asyncio.wait_for``: this is the simulator's innermost wait."""
        loop = asyncio.get_running_loop()
        self._kicked = False
        waiter = self._waiter = loop.create_future()
        timer = None if modelled_s is None else loop.call_later(modelled_s / self.time_scale, _finish, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        kicked, self._kicked = self._kicked, False
        return kicked

    async def _sleep(self, modelled_s: float) -> None:
        self.busy_s += modelled_s
        await asyncio.sleep(modelled_s / self.time_scale)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _used(self) -> int:
        """Modelled tokens in the running requests' KV caches."""
        return self._sum_context + len(self._running) * self._steps - self._sum_joined

    def _context(self) -> float:
        """The running requests' mean context (modelled tokens in their KV caches)."""
        return self._used() / len(self._running)

    def _steps_to_next_end(self) -> int:
        while self._ends[0][2].done or self._ends[0][1] != self._ends[0][2].entry:
            heapq.heappop(self._ends)
        return self._ends[0][0] - self._steps

    def _join(self, r: _Request) -> None:
        r.joined, r.end = self._steps, self._steps + r.records * self.scale - r.base
        self._running[r] = None
        self._order += 1
        r.entry = self._order
        heapq.heappush(self._ends, (r.end, r.entry, r))
        self._sum_context += r.context
        self._sum_joined += r.joined

    def _remove(self, r: _Request) -> None:
        """``r`` out of the running batch, its tokens so far written out."""
        self._running.pop(r, None)
        self._sum_context -= r.context
        self._sum_joined -= r.joined
        have, due = len(r.output_ids), min((r.base + self._steps - r.joined) // self.scale, r.records)
        if due > have:
            seed = r.request.sampling.seed
            if seed is None:  # a slice of a pool drawn once: per-token draws were most of the simulator's time
                start = self._rng.randrange(len(self._pool_ids) - (due - have)) if due - have < len(self._pool_ids) \
                    else 0
                r.output_ids.extend(_cycle(self._pool_ids, start, due - have))
                r.output_logprobs.extend(_cycle(self._pool_logprobs, start, due - have))
            else:  # position by position, so a continued request draws what the uninterrupted one would have
                for position in range(len(r.request.input_ids) + have, len(r.request.input_ids) + due):
                    rng = random.Random(_mix(seed, position, 1))
                    r.output_ids.append(rng.randrange(self.vocab_size))
                    r.output_logprobs.append(-rng.expovariate(1.0))
            r.output_versions.extend([self._version] * (due - have))

    def _preempt(self) -> None:
        """The request that joined last gives its KV cache back and waits at the head of the queue with the
        tokens it has (vLLM's recompute preemption): when it joins again its whole context is prefilled."""
        r = next(reversed(self._running))
        produced = self._steps - r.joined
        self._remove(r)
        r.base += produced
        self._waiting.appendleft(r)
        self.preempted += 1

    def _leave(self, r: _Request, stop_reason: str) -> None:
        """``r`` leaves the batch with the tokens its steps completed."""
        self._remove(r)
        if stop_reason == "abort":
            _remember(r)
        r.finish(stop_reason)

    def _credit(self, now: float) -> None:
        """Give the running requests the decode steps of the current stretch that ended by ``now``, finish those
        that have all their tokens, and close the stretch; the engine was busy for all of it (a step cut short
        by a pause is work thrown away)."""
        if self._stretch is None:
            return
        began, batch, context, prefill, full, most = self._stretch
        self._stretch = None
        table = self.profile.inference.decode_step_s
        elapsed = max(0.0, (now - began) * self.time_scale)
        done = most if elapsed >= full else table.steps_within(batch, context, max(0.0, elapsed - prefill), most)
        self.busy_s += min(elapsed, full)
        self._steps += done
        self.tokens += done * len(self._running)
        while self._ends and self._ends[0][0] <= self._steps:
            _, entry, r = heapq.heappop(self._ends)
            if not r.done and entry == r.entry and r in self._running:
                limit = r.request.sampling.max_new_tokens
                self._leave(r, "length" if r.records >= limit and r.target >= limit else "stop")

    async def _run(self) -> None:
        """Event-driven continuous batching: between two events (a request joins or finishes, a pause) the
        batch is fixed, so the whole stretch of decode steps is one wait (``DecodeTable.sum_steps``)."""
        capacity = self.profile.inference.kv_capacity_tokens
        table = self.profile.inference.decode_step_s
        while True:
            if self._paused or not (self._waiting or self._running):
                await self._wait(None)
                continue
            # the running requests' next tokens first: while they do not fit, the last to join is preempted
            while len(self._running) > 1 and self._used() + len(self._running) > capacity:
                self._preempt()
            joined_prompt, joined = 0, 0
            shared = set() if self.profile.inference.shared_prompts else None
            # then waiting requests, while their context (and the step's tokens of all) fit; a request alone in
            # the batch runs whatever its size
            while self._waiting and (not self._running or self._used() + len(self._running) + self._waiting[0].context
                                     + 1 <= capacity):
                item = self._waiting.popleft()
                if item.base:  # a preempted request: its prompt and the tokens it had are prefilled again
                    joined_prompt += item.context
                    self.recomputed_tokens += item.context
                elif shared is None:
                    joined_prompt += item.prompt
                else:  # identical prompts joining together are prefilled once
                    key = tuple(item.request.input_ids)
                    if key not in shared:
                        shared.add(key)
                        joined_prompt += item.prompt
                self._join(item)
                joined += 1
            batch = len(self._running)
            context = self._context()
            # with each request, the controller's CPU that comes out of this server's core (a shared CPU only)
            prefill = self.profile.inference.prefill_s(joined_prompt) + joined * self.profile.inference.side_s_per_request
            k = self._steps_to_next_end()
            if batch > 1:  # the stretch ends where the cache is full, if that comes before a request finishes
                k = min(k, max(1, (capacity - self._used()) // batch))
            full = prefill + table.sum_steps(batch, context, k)
            self._stretch = (self._now(), batch, context, prefill, full, k)
            self.events += 1
            kicked = await self._wait(full)  # not kicked: the stretch ran to its end (the first request finishes)
            if self._paused or self._stretch is None:  # pause() credited the steps done and answered everyone
                continue
            if kicked and self._waiting:
                # a request arrived: it joins at the end of the step in progress, which we wait out
                began, b, c, p, _, _ = self._stretch
                elapsed = (self._now() - began) * self.time_scale - p
                done = table.steps_within(b, c, max(0.0, elapsed), k)
                boundary = p + table.sum_steps(b, c, min(done + 1, k))
                if boundary > elapsed + 1e-12 and done < k:
                    await asyncio.sleep((boundary - max(0.0, elapsed)) / self.time_scale)
                    if self._paused or self._stretch is None:
                        continue
            self._credit(self._now() + 1e-9 / self.time_scale)

    async def pause(self) -> None:
        """Every request in flight comes back now with the tokens it has and ``abort`` (a preempted one too);
        those that have not started wait."""
        self._credit(self._now())
        self._paused = True
        for r in list(self._running):
            self.aborted += 1
            self._leave(r, "abort")
        for r in [r for r in self._waiting if r.base]:
            self._waiting.remove(r)
            self.aborted += 1
            _remember(r)
            r.finish("abort")  # with the tokens written out when it was preempted
        self._ends.clear()
        self._kick()

    async def resume(self) -> None:
        self._paused = False
        self._kick()

    def _update_s(self) -> float:
        """A weight update's modelled seconds: a transfer from the trainer's GPUs, or colocated, a reload in place
        (the full weights gathered from the trainer's shards over NVLink). Colocated, the memory switch between the
        roles (the KV cache and optimizer state moved out and back) is not charged: the baseline is a lower bound."""
        weights = self.profile.weights
        if self.colocated and self.profile.train.tp_link_gbps > 0:
            return weights.bytes / (self.profile.train.tp_link_gbps * 1e9 / 8) + self.profile.train.tp_latency_s
        return weights.transfer_s()

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._sleep(self._update_s())
        self._version = version

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        # sim.stall_s: the server's share of an export that ran beside it on a shared CPU (areal_sim.train)
        stall_s = sum(float(t) for name, t in named_tensors if name == "sim.stall_s")
        await self._sleep(self._update_s() + stall_s)
        self._version = version

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for r in [*self._running, *self._waiting]:
            r.finish("abort")
        self._running.clear()
        self._ends.clear()
        self._waiting.clear()
