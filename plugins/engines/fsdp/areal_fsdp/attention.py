"""Attention over packed sequences, one sequence at a time: cost sum(n_i^2), not T^2.

A packed micro-batch is one row of ``T`` tokens holding sequences of lengths
``n_1 .. n_k``. Plain ``sdpa`` with the block-diagonal mask
(:func:`areal_fsdp.logprobs.packed_attention_mask`) computes every one of the
``T^2`` query/key pairs and masks most of them away: for an RL batch of 16
completions of ~50 tokens that is 640k pairs for 45k useful ones, and the
CPU flash kernel's backward with an explicit mask was 14 % of a training
step in a profile. Here each sequence's slice of the row goes through
``F.scaled_dot_product_attention(..., is_causal=True)`` on its own, with no
mask tensor at all (not even the ``[T, T]`` one), and the outputs are
concatenated back in row order. Results equal the masked computation to
float rounding (the tests compare them).

transformers routes attention through a registry
(``AttentionInterface``); :func:`register` adds this function under
:data:`PACKED_SDPA` and a mask builder that builds nothing, and the engine
passes the row's sequence boundaries as the ``areal_cu_seqlens`` keyword,
which transformers forwards from the model call to every attention layer.
FlashAttention-2's varlen kernel does the same on GPUs; on CPU nothing in
torch or transformers does, hence this short function.

Models with sliding-window layers or attention-logit soft-capping keep the
masked ``sdpa`` path (:func:`supports` says which).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

PACKED_SDPA = "areal_packed_sdpa"
CU_SEQLENS = "areal_cu_seqlens"


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention per packed sequence. query [1, H, T, D], key / value [1, H_kv, T, D] -> [1, T, H, D]."""
    cu = kwargs.get(CU_SEQLENS)
    if cu is None:
        raise RuntimeError(f"{PACKED_SDPA}: the model was called without {CU_SEQLENS}; the fsdp engine passes "
                           "the packed row's sequence boundaries with every forward")
    if query.shape[0] != 1:
        raise RuntimeError(f"{PACKED_SDPA}: expects one packed row, got a batch of {query.shape[0]}")
    gqa = query.shape[1] != key.shape[1]
    drop = dropout if module.training else 0.0
    pieces = [
        F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=drop,
                                       is_causal=True, scale=scaling, enable_gqa=gqa)
        for s, e in zip(cu[:-1], cu[1:])
    ]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    return None


def register() -> None:
    """Make :data:`PACKED_SDPA` a name transformers' ``set_attn_implementation`` accepts (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, _no_mask)


def supports(config: Any) -> bool:
    """Whether a model of ``config`` can attend per sequence: no sliding-window layers, no logit soft-capping."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
        return False
    return getattr(config, "attn_logit_softcapping", None) is None
