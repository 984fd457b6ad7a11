"""Test doubles for the integrity gate on weight updates (``rollout.weight_check``): an inference engine and a
train engine that both run one tiny HF model in this process, the engine with a loader bug on demand.

:class:`FaultyEngineDouble` keeps two things, as a real engine does: the weights it *holds* (what its digest
reads) and the weights it *computes with*, derived from them at every load (a real engine's packed, fused or
cast copies). ``fault`` makes the load go wrong one way:

- ``"permute:NAME"``: tensor NAME is stored with its rows reversed (a layout bug);
- ``"corrupt:NAME"``: one element of NAME is overwritten;
- ``"skip:PREFIX"``: every tensor whose name starts with PREFIX (a layer's bucket) is not loaded;
- ``"cast:NAME"``: NAME is held as sent, but the copy computed with reads its bytes as float16 (a wrong dtype
  cast in the compute path: the digest of what is held cannot see it, the parity probe can).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Iterable

import torch

from areal_core.api import GenerationResponse, InferenceEngine, TrainEngine
from areal_core.weight_check import digest_named


def load_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def sequence_logprobs(model: Any, tokens: list[int]) -> list[float]:
    """Per token, its logprob given those before (0.0 for the first), at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0] + logp.tolist()


class FaultyEngineDouble(InferenceEngine):
    """An in-process engine over a tiny model that takes tensors and reports digests; see the module."""

    capabilities = frozenset({"pause", "update_weights_from_tensors", "weight_digest"})

    def __init__(self, model_path: str, address: str, fault: str = "", digest_delay_s: float = 0.0,
                 load_delay_s: float = 0.0) -> None:
        super().__init__()
        self.address = address
        self.held = load_model(model_path)
        self.compute = copy.deepcopy(self.held)
        self.fault = fault
        self.digest_delay_s = digest_delay_s  # a digest that hangs (the phase timeouts' test)
        self.load_delay_s = load_delay_s  # ... and a load
        self._version = 0
        self.digest_calls = 0
        self.loads = 0

    @property
    def version(self) -> int:
        return self._version

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

    async def weight_digest(self, mode: str = "on") -> dict[str, str]:
        self.digest_calls += 1
        await asyncio.sleep(self.digest_delay_s)
        return digest_named(self.held.state_dict().items(), mode)

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
    export hands out copies in one bucket per layer, ``forward_logprobs`` scores with the model."""

    capabilities = frozenset({"export_tensors"})

    def __init__(self, model_path: str) -> None:
        super().__init__()
        self.model = load_model(model_path)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def step(self, scale: float = 0.01) -> None:
        generator = torch.Generator().manual_seed(1000 + self._version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * scale)
        self._version += 1

    def export_tensors(self, bucket_bytes: int) -> Any:
        from areal_core.remote import layer_of

        buckets: dict[str, list] = {}
        for name, tensor in self.model.state_dict().items():
            buckets.setdefault(layer_of(name), []).append((name, tensor.detach().clone()))
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
