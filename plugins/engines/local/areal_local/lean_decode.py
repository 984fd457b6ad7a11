"""One decode step of a Llama-family model written out, for CPU generation.

Why: a decode step at batch 16 on SmolLM2-135M is ~30 layers of small
operations, and on two CPU cores the Python and dispatch cost of the
``transformers`` forward (per-layer projections called one by one, the
attention interface, the cache interface, mask handling, output objects) was
about a third of the step in a profile. Here the same computation runs from
the model's own modules and weights with fewer, larger operations:

- q, k and v come from ONE matmul on their concatenated weights, gate and up
  from another (oneDNN-prepacked, like :mod:`areal_local.packed`);
- the rotary cos / sin are computed once per step by the model's own
  ``rotary_emb``;
- new keys / values are written straight into the generator's
  :class:`~areal_local.cache.SlotCache` buffers and attention is one
  ``scaled_dot_product_attention`` call per layer over them (grouped-query
  heads without copies);
- with packed weights, the residual adds, the SiLU and the gate x up
  product ride on the matmuls as oneDNN post-ops (``o_proj`` and
  ``down_proj`` add the residual, ``gate_proj`` applies SiLU, ``up_proj``
  multiplies by the gate: ~6% of a bf16 step at batch 16 on SmolLM2);
- rotary embeddings are applied to q and k together, rotating halves by a
  flip instead of ``rotate_half``'s slices, negation and concatenation;
- the norms and the embedding are the model's own modules.

Prefill still goes through the ``transformers`` forward. Only architectures
whose decoder layer is exactly "norm, attention, residual, norm, gated MLP,
residual" with full attention are taken (:func:`supports`); anything else
(sliding windows, other layer layouts) keeps the plain forward. Tests compare
the two token for token.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from areal_local.packed import repack

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def supports(model: Any) -> bool:
    """Whether :class:`LeanDecoder` reproduces ``model``'s forward: a Llama-family layout, full attention."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or getattr(config, "use_sliding_window", False):
        return False
    if getattr(config, "sliding_window", None) and config.model_type == "mistral":
        return False
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return False
    inner = getattr(model, "model", None)
    layer = inner.layers[0] if inner is not None and len(getattr(inner, "layers", [])) else None
    if layer is None or not hasattr(inner, "rotary_emb"):
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    needed = [(attention, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))]
    if any(part is None or not all(hasattr(part, n) for n in names) for part, names in needed):
        return False
    module = inspect.getmodule(type(attention))
    return hasattr(module, "apply_rotary_pos_emb")


class LeanDecoder:
    """Decode steps of ``model`` over a :class:`~areal_local.cache.SlotCache`; see the module docstring."""

    def __init__(self, model: Any, *, packed: Any = None) -> None:
        """``packed``: the generator's :class:`~areal_local.packed.PackedLinears` (None: torch's own linears);
        its packed copies of o / gate / up / down / head are used as they are, not packed again."""
        if not supports(model):
            raise ValueError(f"LeanDecoder: {type(model).__name__} is not a supported Llama-family model")
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, list(inner.layers), inner.norm, inner.rotary_emb
        self.head = model.lm_head
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.n_heads = model.config.num_attention_heads
        self.n_kv = model.config.num_key_value_heads
        self._packs = packed
        # rotate_half(t) = cat(-t2, t1) = flip of t's halves, the first negated: the sign is folded into sin.
        self._sign = torch.ones(self.head_dim, dtype=next(model.parameters()).dtype)
        self._sign[: self.head_dim // 2] = -1
        Weight = tuple[torch.Tensor, torch.Tensor | None]
        self._qkv: list[Weight] = []
        self._gate_up: list[Weight] = []  # plain path: one matmul for gate and up
        self._mlp: list[tuple[Weight, Weight, Weight]] = []  # packed path: gate, up, down with post-ops
        self._o: list[Weight] = []
        self.refresh()

    @property
    def packed(self) -> bool:
        """Whether the linears run on oneDNN-packed weights (the generator's PackedLinears)."""
        return self._packs is not None

    def refresh(self) -> None:
        """Rebuild the fused / packed weights (after a weight load)."""
        jobs, finish = self.jobs()
        for _, job in jobs:
            job()
        finish()

    def jobs(self) -> tuple[list[tuple[int, Callable[[], None]]], Callable[[], None]]:
        """:meth:`refresh` as one job per fused weight, (elements, call), which may run on several threads,
        and the call that puts their results in place once all have run (after the PackedLinears' own jobs:
        the packed path takes their copies of o / gate / up / down)."""
        n = len(self.layers)
        old = self._qkv if len(self._qkv) == n else [None] * n
        qkv: list = list(old)
        gate_up: list = [None] * n

        def fuse(results: list, i: int, parts: tuple, was: Any) -> tuple[int, Callable[[], None]]:
            def run() -> None:
                with torch.no_grad():
                    results[i] = self._fuse(*parts, into=was)
            return sum(m.weight.numel() for m in parts), run

        jobs = []
        for i, layer in enumerate(self.layers):
            jobs.append(fuse(qkv, i, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), old[i]))
            if self._packs is None:
                jobs.append(fuse(gate_up, i, (layer.mlp.gate_proj, layer.mlp.up_proj), None))

        def finish() -> None:
            self._qkv = qkv
            if self._packs is not None:
                self._mlp = [(self._packed(layer.mlp.gate_proj), self._packed(layer.mlp.up_proj),
                              self._packed(layer.mlp.down_proj)) for layer in self.layers]
                self._o = [self._packed(layer.self_attn.o_proj) for layer in self.layers]
            else:
                self._gate_up = gate_up

        return jobs, finish

    def _packed(self, linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._packs.weight_of(linear), linear.bias

    def _fuse(self, *linears: torch.nn.Linear,
              into: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One weight (and bias) for ``linears`` stacked; packed, into ``into``'s packed weight when given."""
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        if all(b is None for b in biases):
            bias = None
        else:
            bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.weight.shape[0])
                              for b, m in zip(biases, linears)])
        if self.packed:
            weight = repack(into[0] if into is not None else None, weight)
        return weight, bias

    def _linear(self, x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None],
                post: str = "none") -> torch.Tensor:
        """``x @ W.T + b``, then ``post`` ("swish" only with packed weights)."""
        weight, bias = fused
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post, [], "")
        return F.linear(x, weight, bias)

    @staticmethod
    def _linear_then(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None], other: torch.Tensor,
                     op: str) -> torch.Tensor:
        """``(x @ W.T + b) <op> other`` in one oneDNN call (packed weights; ``op`` "add" or "mul")."""
        weight, bias = fused
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, op)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any, mask: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[B, V]`` of one new token per row.

        ``ids`` / ``positions`` [B]; ``mask`` [B, L] bool (True = attend) over
        the ``L`` cache columns the step reads; the cache's decode plan (set by
        the generator) says where each row's new key and value go.
        """
        B, d = ids.shape[0], self.head_dim
        half = d // 2
        x = self.embed(ids[:, None])  # [B, 1, H]
        cos, sin = self.rotary(x, positions[:, None])  # [B, 1, d]
        cos, sin = cos[:, :, None, :], (sin * self._sign.to(sin.dtype))[:, :, None, :]  # [B, 1, 1, d]
        attn_mask = mask[:, None, None, :]
        q_size, kv_size = self.n_heads * d, self.n_kv * d
        heads = self.n_heads + self.n_kv  # q and k heads, rotated together
        gqa = self.n_heads != self.n_kv
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            qkv = self._linear(h, self._qkv[i])
            qk = qkv[..., : q_size + kv_size].view(B, 1, heads, d)
            qk = qk * cos + qk.view(B, 1, heads, 2, half).flip(-2).view(B, 1, heads, d) * sin
            q = qk[:, :, : self.n_heads].transpose(1, 2)
            k = qk[:, :, self.n_heads :].transpose(1, 2)
            v = qkv[..., q_size + kv_size :].view(B, 1, self.n_kv, d).transpose(1, 2)
            keys, values = cache.update(k, v, i)  # writes this step's column, returns [B, kv, L, d]
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=self.scaling,
                                               enable_gqa=gqa)
            a = a.transpose(1, 2).reshape(B, 1, q_size)
            if self.packed:
                x = self._linear_then(a, self._o[i], x, "add")
                h = layer.post_attention_layernorm(x)
                gate_w, up_w, down_w = self._mlp[i]
                gated = self._linear_then(h, up_w, self._linear(h, gate_w, "swish"), "mul")
                x = self._linear_then(gated, down_w, x, "add")
            else:
                x = x + layer.self_attn.o_proj(a)
                h = layer.post_attention_layernorm(x)
                gate, up = self._linear(h, self._gate_up[i]).chunk(2, dim=-1)
                x = x + layer.mlp.down_proj(F.silu(gate) * up)
        return self.head(self.norm(x))[:, -1].float()  # packed through PackedLinears' forward when packed
