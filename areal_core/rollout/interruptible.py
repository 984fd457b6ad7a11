"""The engine workflows see: routes requests over the inference engines and
hides interruptions.

When the controller pauses generation for a weight update, engines return
what each in-flight request produced so far with ``stop_reason="abort"``.
This facade waits until generation resumes and continues the same request
from prompt + partial output under the new weights, so a workflow receives
one response whose tokens may carry several policy versions, each with the
behaviour logprob of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from areal_core.api.inference import GenerationRequest, GenerationResponse, InferenceEngine

# An engine answering "abort" while generation is open, with no new token,
# this many times in a row is broken rather than interrupted.
MAX_IDLE_ABORTS = 3


class InterruptibleEngine(InferenceEngine):
    """Facade over one or more engines (the ``d`` servers of an allocation)."""

    def __init__(self, engines: list[InferenceEngine], request_timeout_s: float = 600.0) -> None:
        super().__init__()
        if not engines:
            raise ValueError("InterruptibleEngine needs at least one inference engine")
        self.engines = list(engines)
        self.request_timeout_s = request_timeout_s
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = [0] * len(self.engines)

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    @property
    def in_flight(self) -> int:
        """Requests now inside an engine call."""
        return sum(self._in_flight)

    def close_gate(self) -> None:
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    def _pick(self) -> int:
        """The engine with the fewest requests in flight (first on ties)."""
        return min(range(len(self.engines)), key=self._in_flight.__getitem__)

    async def _call(self, request: GenerationRequest) -> GenerationResponse:
        index = self._pick()
        self._in_flight[index] += 1
        try:
            return await asyncio.wait_for(self.engines[index].agenerate(request), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"waited {self.request_timeout_s:.0f} s (rollout.request_timeout_s) for inference "
                f"engine {index} ({type(self.engines[index]).__name__}) to answer request "
                f"{request.rid} ({len(request.input_ids)} prompt tokens)"
            ) from None
        finally:
            self._in_flight[index] -= 1

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        budget = request.sampling.max_new_tokens
        out_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        idle_aborts = 0
        while True:
            await self._open.wait()
            part = await self._call(replace(
                request,
                input_ids=request.input_ids + out_ids,
                sampling=replace(request.sampling, max_new_tokens=budget - len(out_ids)),
            ))
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
