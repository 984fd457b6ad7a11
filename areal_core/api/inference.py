"""The inference engine contract: token-in / token-out generation with versions."""

from __future__ import annotations

import uuid
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from areal_core.api.component import Component

STOP_REASONS = ("stop", "length", "abort")


class ServerTimeout(TimeoutError):
    """An inference server did not answer a call, or finish a phase of a weight update, within
    ``rollout.request_timeout_s``: the message names the server, what was waited for, the wait and the fix. The
    trainer ends the run with it as one paragraph, not a traceback."""

@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class GenerationRequest:
    """Prompt tokens in; never text, so the trainer sees exactly what was sampled."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict = field(default_factory=dict)


@dataclass
class GenerationResponse:
    """Sampled tokens out, each with its behaviour logprob and the policy version that produced it.

    ``stop_reason`` is ``"stop"`` (stop string / token / EOS), ``"length"``
    (``max_new_tokens`` reached) or ``"abort"`` (interrupted: the output so far
    is returned and may be continued from ``input_ids + output_ids``).
    """

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"GenerationResponse {self.rid}: {n} output tokens but "
                f"{len(self.output_logprobs)} logprobs and {len(self.output_versions)} versions; "
                "an engine must return one of each per token"
            )
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"GenerationResponse.stop_reason must be one of {STOP_REASONS}, got {self.stop_reason!r}")


@dataclass
class ServerProcess:
    """A server the launcher starts for an engine and waits for before training starts.

    ``ready()`` is polled until True (for up to ``startup_timeout_s``);
    ``what`` names what is waited for in a timeout error ("the /health
    endpoint of the vLLM server on 127.0.0.1:8001").
    """

    argv: list[str]
    ready: Callable[[], bool]
    what: str
    env: dict = field(default_factory=dict)
    startup_timeout_s: float = 300.0


class InferenceEngine(Component):
    """A generation backend the rollout controller drives (entry-point group ``areal.engines.inference``).

    Capabilities: ``"pause"`` (pause / resume with partial outputs returned as
    ``abort``), ``"update_weights_from_disk"``, ``"update_weights_from_tensors"``,
    ``"seed"`` (same seed, same tokens), ``"update_weights_from_delta"`` (only the elements that
    changed since the version held), ``"weight_digest"`` (:meth:`weight_digest`: the
    integrity gate of ``rollout.weight_check`` compares what the engine holds with what the
    trainer sent after every update; engines without it get the parity probe only).
    """

    @classmethod
    def server_process(cls, context: Any, index: int, port: int) -> ServerProcess | None:
        """The process the launcher runs as server ``index`` (of the allocation's ``d``) on ``port``.

        None (the default): the engine lives inside the trainer process. When
        a server is started, the engine built in the trainer finds its
        address in ``context.extras["address"]`` (``"127.0.0.1:<port>"``).
        A launcher that places servers on other machines sets
        ``context.extras["host"]``: the address the server must listen on
        (its node's, reachable from the trainer's node); 127.0.0.1 when it
        is absent. The engine built in the trainer finds in
        ``context.extras["same_node"]`` whether its server shares the
        trainer's node, and in ``context.extras["exchange_dir"]`` a folder
        on the run's shared storage for weights that cannot go through
        shared memory.
        """
        return None

    async def start(self) -> None:
        """Connect (wait for readiness with a timeout); called on the controller's loop."""

    @abstractmethod
    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        """Generate for one request; many may be awaited concurrently."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the weights now loaded."""

    async def pause(self) -> None:
        """Stop decoding; in-flight requests return what they have with ``stop_reason="abort"``."""
        raise NotImplementedError(f"{type(self).__name__} does not declare the 'pause' capability")

    async def resume(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not declare the 'pause' capability")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load HF safetensors from ``path`` between decode steps; then report ``version``."""
        raise NotImplementedError(f"{type(self).__name__} does not declare 'update_weights_from_disk'")

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load weights handed over in memory (buckets of (name, tensor))."""
        raise NotImplementedError(f"{type(self).__name__} does not declare 'update_weights_from_tensors'")

    async def update_weights_from_delta(self, delta: Any, version: int) -> None:
        """Apply an :class:`areal_core.weight_delta.WeightDelta` (tensors whole, and flat indices + values of the
        changed elements) to the weights held, then report ``version``. Only on exactly ``delta.base_version``:
        an engine holding any other version raises :class:`areal_core.weight_delta.DeltaBaseMismatch` having
        changed nothing, and the controller sends it the full weights instead. Capability
        ``"update_weights_from_delta"`` (``rollout.weight_delta: auto`` uses it when every routed engine has it)."""
        raise NotImplementedError(f"{type(self).__name__} does not declare 'update_weights_from_delta'")

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        """Per tensor name, :func:`areal_core.weight_check.tensor_digest` of the weights now loaded, computed where
        they landed, after any layout change the engine made: each in the name, shape and dtype the trainer
        sends (HF names), so a fused or transposed weight is mapped back before it is hashed. ``mode`` is
        ``"on"`` (every byte) or ``"sample"`` (the blocks ``tensor_digest`` picks). Declare ``"weight_digest"``
        when implemented; tensors beyond those the trainer sends may be reported and are ignored."""
        raise NotImplementedError(f"{type(self).__name__} does not declare 'weight_digest'")

    def sent_digests(self, weights: str | list[tuple[str, Any]], mode: str = "on") -> dict[str, str]:
        """The trainer's side of the integrity gate: per name, the digest :meth:`weight_digest` must report once
        ``weights`` are loaded (a safetensors folder's path, or the (name, tensor) pairs handed over). Called on
        the trainer's rank 0, on the first routed engine (every routed engine is of one backend and one server
        shape), after ``start()``, for every update the gate checks; synchronous (it may run on a helper thread).

        The default, right for every engine that maps what it holds back to what was sent, is the trainer's own
        names and hash (:func:`areal_core.weight_check.digest_weights`). An engine whose server can only hash
        the weights in its own layout (fused, sharded, its own hash function) overrides it to compute, from
        what the trainer sends, what its server will report; a tensor it cannot say that for it marks
        ``"<NOT_CHECKABLE>: <why>"`` (:data:`~areal_core.weight_check.NOT_CHECKABLE`), which the check skips and
        the run log names, as it does for what :meth:`weight_digest` reports so."""
        from areal_core.weight_check import digest_weights

        return digest_weights(weights, mode)

    def export_destination(self, version: int) -> Any:
        """Where the trainer may export the tensors of ``version`` straight away, so that its export's copy is
        the transfer: a callable ``(name, shape, dtype) -> tensor or None`` (memory the next
        :meth:`update_weights_from_tensors` of ``version`` reads without copying; None for a tensor it has no
        place for), with a ``complete()`` method the trainer calls once the export ended whole; or None (the
        default: the engine takes tensors of the trainer's own). The trainer uses it only when every routed
        engine gives the same object and its train engine declares ``"export_into"``."""
        return None

    def weight_transport(self, weight_sync: str) -> str:
        """How this engine's new weights travel under ``rollout.weight_sync`` (logged, and counted in the
        metrics as ``weight_sync/servers_<transport>``). Engines whose path depends on where they run (shared
        memory on the trainer's node, something else across nodes) say which they picked."""
        return "disk_folder" if weight_sync == "disk" else "tensors"

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        """Stop the engine and everything it started; idempotent."""
