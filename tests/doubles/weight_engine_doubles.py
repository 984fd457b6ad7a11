"""Test doubles for the integrity gate on weight updates (``rollout.weight_check``): an inference engine and a
train engine that both run one tiny HF model in this process, the engine with a loader bug on demand.

:class:`FaultyEngineDouble` keeps two things, as a real engine does: the weights it *holds* (what its digest
reads) and the weights it *computes with*, derived from them at every load (a real engine's packed, fused or
cast copies). ``fault`` makes the load go wrong one way:

- ``"permute:NAME"``: tensor NAME is stored with its rows reversed (a layout bug);
- ``"corrupt:NAME"``: one element of NAME is overwritten;
- ``"skip:PREFIX"``: every tensor whose name starts with PREFIX (a layer's bucket) is not loaded;
- ``"cast:NAME"``: NAME is held as sent, but the copy computed with reads its bytes as float16 (a wrong dtype
  cast in the compute path: the digest of what is held cannot see it, the parity probe can);
- ``"drop:NAME"``: a delta's changed elements of NAME are not applied;
- ``"uncheckable:NAME"``: loaded right, but the digest reports NAME as not checkable (as an engine does for a
  tensor it quantised or sharded).

It takes deltas (``update_weights_from_delta``) on exactly the version it holds, as the contract says.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any, Iterable

import torch

from areal_core.api import GenerationResponse, InferenceEngine, TrainEngine
from areal_core.weight_check import NOT_CHECKABLE, digest_named


def load_model(path: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def sequence_logprobs(model: Any, tokens: list[int]) -> list[float]:
    """Per token, its logprob given those before (0.0 for the first), at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0] + logp.tolist()


class FaultyEngineDouble(InferenceEngine):
    """An in-process engine over a tiny model that takes tensors and reports digests; see the module."""

    capabilities = frozenset({"pause", "update_weights_from_tensors", "update_weights_from_delta", "weight_digest"})

    def __init__(self, model_path: str, address: str, fault: str = "", digest_delay_s: float = 0.0,
                 load_delay_s: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.address = address
        self.held = load_model(model_path, dtype)
        self.compute = copy.deepcopy(self.held)
        self.fault = fault
        self.digest_delay_s = digest_delay_s  # a digest that hangs (the phase timeouts' test)
        self.load_delay_s = load_delay_s  # ... and a load
        self._version = 0
        self.digest_calls = 0
        self.loads = 0
        self.deltas = 0  # updates taken as deltas
        self.claims_version: int | None = None

    @property
    def version(self) -> int:
        """The version held, or ``claims_version`` when a test sets it (a client whose idea of it is stale)."""
        return self._version if self.claims_version is None else self.claims_version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        await asyncio.sleep(self.load_delay_s)
        kind, _, target = self.fault.partition(":")
        own = self.held.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if kind == "skip" and name.startswith(target):
                    continue
                own[name].copy_(tensor)
        self._after_load(version)

    async def update_weights_from_delta(self, delta: Any, version: int) -> None:
        from areal_core.weight_delta import DeltaBaseMismatch, apply_delta

        if delta.base_version != self._version:
            raise DeltaBaseMismatch(f"{self.address} holds version {self._version}, the delta is from "
                                    f"{delta.base_version}")
        await asyncio.sleep(self.load_delay_s)
        kind, _, target = self.fault.partition(":")
        if kind == "drop":  # a copy: every engine is handed the same delta
            delta = dataclasses.replace(delta, sparse=[entry for entry in delta.sparse if entry[0] != target])
        apply_delta(self.held.state_dict(), delta)
        self.deltas += 1
        self._after_load(version)

    def _after_load(self, version: int) -> None:
        kind, _, target = self.fault.partition(":")
        own = self.held.state_dict()
        with torch.no_grad():
            if kind == "permute":
                own[target].copy_(own[target].flip(0))
            elif kind == "corrupt":
                own[target].view(-1)[0] += 1.0
            self.compute.load_state_dict(self.held.state_dict())
            if kind == "cast":
                wrong = own[target].to(torch.bfloat16).view(torch.float16).to(own[target].dtype)
                self.compute.state_dict()[target].copy_(wrong)
        self.loads += 1
        self._version = version
        self.claims_version = None

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        self.digest_calls += 1
        await asyncio.sleep(self.digest_delay_s)
        digests = digest_named(self.held.state_dict().items(), mode)
        kind, _, target = self.fault.partition(":")
        if kind == "uncheckable":
            digests[target] = f"{NOT_CHECKABLE}: quantised by the engine double"
        return digests

    async def agenerate(self, request: Any) -> GenerationResponse:
        s = request.sampling
        generator = torch.Generator().manual_seed(s.seed if s.seed is not None else 0)
        tokens, out, logprobs = list(request.input_ids), [], []
        with torch.no_grad():
            for _ in range(s.max_new_tokens):
                logits = self.compute(torch.tensor([tokens])).logits[0, -1].float()
                logp = torch.log_softmax(logits / (s.temperature or 1.0), dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                tokens.append(token)
                out.append(token)
                logprobs.append(float(logp[token]))
        return GenerationResponse(request.rid, list(request.input_ids), out, logprobs, [self._version] * len(out),
                                  "length")


class TinyActorDouble(TrainEngine):
    """A train engine double over the same tiny model: :meth:`step` changes every weight (one version), the
    export hands out copies in ``dtype`` (the master weights stay float32, as a real trainer's), one bucket per
    layer; ``forward_logprobs`` scores with the model."""

    capabilities = frozenset({"export_tensors"})

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.model = load_model(model_path)
        self.dtype = dtype
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def step(self, scale: float = 0.01) -> None:
        """One version: every weight moves by ``scale`` times a normal draw times its own size."""
        generator = torch.Generator().manual_seed(1000 + self._version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs())
        self._version += 1

    def export_tensors(self, bucket_bytes: int) -> Any:
        from areal_core.remote import layer_of

        buckets: dict[str, list] = {}
        for name, tensor in self.model.state_dict().items():
            buckets.setdefault(layer_of(name), []).append((name, tensor.detach().to(self.dtype, copy=True)))
        return iter(buckets.values())

    def forward_logprobs(self, batch: Any, temperature: float = 1.0) -> dict:
        out: list[float] = []
        cu = batch["cu_seqlens"]
        ids = list(batch["input_ids"])
        for start, end in zip(cu[:-1], cu[1:]):
            out += sequence_logprobs(self.model, ids[start:end])
        return {"logprobs": out}

    def train_batch(self, batch: Any, loss_fn: Any, temperature: float = 1.0) -> dict:
        raise NotImplementedError("TinyActorDouble only exports and scores")


class HandOverRig:
    """The trainer's real :class:`~areal_core.trainer_weights.WeightHandOver` and a started rollout controller over
    :class:`FaultyEngineDouble` engines (one per fault; "" = healthy), fed by a :class:`TinyActorDouble`.
    ``made``: the engines built for reloads (elastic). Call :meth:`close` at the end."""

    def __init__(self, model: str, run_dir: Any, faults: list[str], *, elastic: bool = False,
                 request_timeout_s: float = 600.0, dtype: torch.dtype = torch.float32, **rollout: Any) -> None:
        from areal_core.config.schema import RunConfig
        from areal_core.rollout import RolloutController
        from areal_core.rollout.elastic import ElasticConfig
        from areal_core.testing.latency_engine import GroupWorkflowDouble
        from areal_core.trainer_weights import WeightHandOver

        self.cfg = RunConfig()
        self.cfg.model.dtype = str(dtype).removeprefix("torch.")
        self.cfg.rollout.max_head_offpolicyness = 0
        self.cfg.rollout.weight_sync = "tensors"
        for key, value in rollout.items():
            setattr(self.cfg.rollout, key, value)
        self.actor = TinyActorDouble(model, dtype)
        self.engines = [FaultyEngineDouble(model, f"server-{i}", fault, dtype=dtype) for i, fault in enumerate(faults)]
        self.made: list[FaultyEngineDouble] = []

        def factory(address: str) -> FaultyEngineDouble:  # a reload after a failed check: a healthy client
            engine = FaultyEngineDouble(model, address, dtype=dtype)
            self.made.append(engine)
            return engine

        self.controller = RolloutController(
            self.engines, GroupWorkflowDouble(), batch_size=1, request_timeout_s=request_timeout_s,
            elastic=ElasticConfig(enabled=True, interval_s=0.05, cooldown_s=0.0) if elastic else None,
            engine_factory=factory, weight_check_holds=self.cfg.rollout.weight_check_holds).start()
        self.handover = WeightHandOver(self.cfg, self.actor, run_dir, 0, 1)
        self.handover.controller = self.controller

    def update(self, scale: float = 0.01) -> float:
        self.actor.step(scale)
        return self.handover.sync(self.actor.version)

    def close(self) -> None:
        self.controller.close()
