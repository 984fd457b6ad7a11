"""The engine workflows see: routes requests over the inference engines and
hides interruptions.

When the controller pauses generation for a weight update, engines return
what each in-flight request produced so far with ``stop_reason="abort"``.
This facade waits until generation resumes and continues the same request
from prompt + partial output under the new weights, so a workflow receives
one response whose tokens may carry several policy versions, each with the
behaviour logprob of the weights that sampled it. With an elastic pool
(:mod:`areal_core.rollout.elastic`), a request whose server fails or leaves
routing continues the same way on another server.

A continuation keeps the request's seed unchanged (and its rid and metadata);
only its input (prompt + output so far) and budget change. An engine that keys
a seeded draw by the token's position in the sequence therefore continues the
request's random stream: the continuation's i-th token draws what the
uninterrupted request's token k+i would have, so draws after a weight swap are
independent of those before it, and under unchanged weights the tokens are
exactly the uninterrupted ones. The embedded engine (``areal_local``) does so.
So does SGLang, whose seeded sampler hashes ``sampling_seed`` with the token
position (it reads the seed only with ``--enable-deterministic-inference``;
otherwise sampling is unseeded). vLLM builds a fresh ``torch.Generator(seed)``
for every request it receives, so there a continuation restarts the seed's
stream; a seed changed here would break the exact continuation on the
position-keyed engines, and this facade does not know which engine serves a
request, so vLLM's plugin derives the seed it sends from the seed and
``len(input_ids)``: independent draws after a swap, though not the
uninterrupted ones.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from areal_core.api.inference import GenerationRequest, GenerationResponse, InferenceEngine
from areal_core.remote import RemoteError
from areal_core.rollout.elastic import (
    INLINE_CALLS, Deadlines, EngineLost, EnginePool, Member, WatchEnded, settle, watched,
)

# An engine answering "abort" while generation is open, with no new token,
# this many times in a row is broken rather than interrupted.
MAX_IDLE_ABORTS = 3
# A request moved to another server this many times (its server failed or left each time) is given up.
MAX_MOVES = 3
# What an engine raises when its server is gone or failing (not a refused request).
ENGINE_FAILURES = (ConnectionError, RemoteError)


class InterruptibleEngine(InferenceEngine):
    """Facade over one or more engines (the ``d`` servers of an allocation, or an elastic pool)."""

    def __init__(self, engines: list[InferenceEngine] | EnginePool, request_timeout_s: float = 600.0) -> None:
        super().__init__()
        self.pool = engines if isinstance(engines, EnginePool) else EnginePool(list(engines))
        self.request_timeout_s = request_timeout_s
        self._deadlines: Deadlines | None = None  # every call's request_timeout_s, made on the loop at first use
        self._open = asyncio.Event()
        self._open.set()

    @property
    def engines(self) -> list[InferenceEngine]:
        """The engines now routed to."""
        return [m.engine for m in self.pool.active()]

    @property
    def version(self) -> int:
        return self.pool.version

    @property
    def in_flight(self) -> int:
        """Requests now inside an engine call."""
        return self.pool.in_flight

    def close_gate(self) -> None:
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    async def _call(self, request: GenerationRequest) -> GenerationResponse:
        member = await self.pool.wait_for_engine(self.request_timeout_s, f"serve request {request.rid}")
        self.pool.acquire(member)
        try:
            return await self._call_on(member, request)
        finally:
            self.pool.release(member)

    async def _call_on(self, member: Member, request: GenerationRequest) -> GenerationResponse:
        try:
            response = await self._answer(member, request)
        except ENGINE_FAILURES as exc:
            if not self.pool.elastic:
                raise
            self.pool.report_failure(member, f"{type(exc).__name__}: {exc}", request=True)
            member.moved += 1
            raise EngineLost(member.name) from exc
        if response is None:
            if member.lost.is_set():
                member.moved += 1
                raise EngineLost(member.name)
            raise TimeoutError(
                f"waited {self.request_timeout_s:.0f} s (rollout.request_timeout_s) for inference "
                f"engine {member.name} ({type(member.engine).__name__}) to answer request "
                f"{request.rid} ({len(request.input_ids)} prompt tokens)"
            )
        member.served += 1
        return response

    async def _answer(self, member: Member, request: GenerationRequest) -> GenerationResponse | None:
        """The engine's answer, or None when ``member`` left routing or the request timed out first."""
        if self._deadlines is None:
            self._deadlines = Deadlines(asyncio.get_running_loop(), self.request_timeout_s)
        if INLINE_CALLS:
            try:
                return await watched(member, member.engine.agenerate(request), self._deadlines)
            except WatchEnded:
                return None
        call = asyncio.ensure_future(member.engine.agenerate(request))
        return call.result() if await settle(member, call, self._deadlines) else None

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        budget = request.sampling.max_new_tokens
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        idle_aborts = 0
        moves = 0
        while True:
            await self._open.wait()
            try:
                # The same seed on purpose: prompt + output so far puts each new token at its uninterrupted
                # position, which is what a position-keyed engine's draw depends on (module docstring).
                part = await self._call(request if not out_ids and budget == request.sampling.max_new_tokens
                                        else replace(request, input_ids=request.input_ids + out_ids,
                                                     sampling=replace(request.sampling,
                                                                      max_new_tokens=budget - len(out_ids))))
            except EngineLost as lost:
                # Its server left: the same continuation goes to another one. A request that fails
                # on server after server is the problem itself; it must not take every server down.
                moves += 1
                if moves > MAX_MOVES:
                    raise RuntimeError(f"request {request.rid} failed on {moves} inference servers in turn (the "
                                       f"last: {lost}); the request, not the servers, is probably at fault: "
                                       f"{lost.__cause__}") from lost.__cause__
                continue
            out_ids += part.output_ids
            logprobs += part.output_logprobs
            versions += part.output_versions
            done = part.stop_reason != "abort" or len(out_ids) >= budget
            if done:
                reason = part.stop_reason if part.stop_reason != "abort" else "length"
                return GenerationResponse(request.rid, request.input_ids, out_ids, logprobs, versions, reason)
            idle_aborts = idle_aborts + 1 if (self._open.is_set() and not part.output_ids) else 0
            if idle_aborts >= MAX_IDLE_ABORTS:
                raise RuntimeError(
                    f"inference engine keeps aborting request {request.rid} while generation is not "
                    f"paused ({idle_aborts} times without a new token); check the engine's log"
                )
