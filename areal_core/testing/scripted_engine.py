"""A test double of an inference engine for workflow authors."""

from __future__ import annotations

from typing import Sequence

from areal_core.api.inference import GenerationRequest, GenerationResponse, InferenceEngine

# Ids no small prompt is likely to contain yet inside every common vocabulary,
# so tokens a workflow keeps verbatim can be told from tokens it re-made.
DEFAULT_SCRIPT: tuple[tuple[int, ...], ...] = (
    (5101, 5102, 5103, 5104, 5105),
    (5201, 5202, 5203),
    (5301, 5302, 5303, 5304),
)


class ScriptedInferenceEngine(InferenceEngine):
    """Test double: an inference engine that samples nothing and replays a script.

    The n-th call to :meth:`agenerate` returns ``script[n % len(script)]``,
    cut at ``max_new_tokens`` (``stop_reason="length"``) or after the first
    of ``stop_token_ids`` (``"stop"``), else whole (``"stop"``). Each token
    gets a distinct negative logprob and the engine's ``version``, so a test
    can tell which tokens came from the engine. Every request and response is
    kept in ``requests`` / ``responses`` for assertions. Not a model: use it
    to test a workflow's bookkeeping, never its quality.
    """

    def __init__(self, script: Sequence[Sequence[int]] = DEFAULT_SCRIPT, *, version: int = 0) -> None:
        super().__init__()
        if not script or any(len(s) == 0 for s in script):
            raise ValueError("ScriptedInferenceEngine needs at least one non-empty scripted output")
        self.script = [list(s) for s in script]
        self._version = version
        self._emitted = 0
        self.requests: list[GenerationRequest] = []
        self.responses: list[GenerationResponse] = []

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Tag later tokens with ``version``, as after a weight update."""
        self._version = version

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        planned = self.script[len(self.requests) % len(self.script)]
        self.requests.append(request)
        out: list[int] = []
        stop_reason = "stop"
        for token in planned:
            if len(out) >= request.sampling.max_new_tokens:
                stop_reason = "length"
                break
            out.append(token)
            if token in request.sampling.stop_token_ids:
                break
        logprobs = [-(0.125 + 0.001 * (self._emitted + i)) for i in range(len(out))]
        self._emitted += len(out)
        response = GenerationResponse(request.rid, list(request.input_ids), out, logprobs,
                                      [self._version] * len(out), stop_reason)
        self.responses.append(response)
        return response
