"""Attention over packed sequences, one sequence at a time: cost sum(n_i^2), not T^2.

A packed micro-batch is one row of ``T`` tokens holding sequences of lengths
``n_1 .. n_k``. Plain ``sdpa`` with the block-diagonal mask
(:func:`areal_fsdp.logprobs.packed_attention_mask`) computes every one of the
``T^2`` query/key pairs and masks most of them away: for an RL batch of 16
completions of ~50 tokens that is 640k pairs for 45k useful ones, and the
CPU flash kernel's backward with an explicit mask was 14 % of a training
step in a profile. Here sequences of similar length are gathered, right-padded,
into a batch ``[n, heads, longest, D]`` and go through
``F.scaled_dot_product_attention(..., is_causal=True)`` together, with no
mask tensor at all (not even the ``[T, T]`` one), and the outputs are
scattered back to their places in the row. Results equal the masked computation to
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

from contextlib import nullcontext
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PACKED_SDPA = "areal_packed_sdpa"
CU_SEQLENS = "areal_cu_seqlens"
# A precomputed plan instead of CU_SEQLENS: buckets that may carry masks (shared prefixes, areal_fsdp.prefix).
PLAN = "areal_attention_plan"


# Sequences of similar length share one padded SDPA call (right padding under a causal mask needs no mask
# tensor: a real query never sees a later, padded key). A bucket grows while its padded cost, count x
# longest^2, stays within this factor of the exact sum of n_i^2; one call per sequence costs ~1 ms of kernel
# overhead each in the CPU flash backward, which dominated for RL-sized (~50-token) sequences.
PADDING_SLACK = 1.5


def buckets(lens: list[int], slack: float = PADDING_SLACK) -> list[list[int]]:
    """Sequence indices grouped by similar length (longest first), each group cheap to pad to its longest."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    exact = 0
    for i in order:
        n = lens[i]
        if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] ** 2 <= slack * (exact + n * n):
            groups[-1].append(i)
            exact += n * n
        else:
            groups.append([i])
            exact = n * n
    return groups


@lru_cache(maxsize=8)
def _gather_plan(cu: tuple[int, ...], device: torch.device) -> list[tuple]:
    """Per bucket: (sequences, longest, longest, src, dst, src, dst, no mask). Token j of the bucket's r-th
    sequence i is row cu[i] + j of the packed tensors and row r * longest + j of the padded ones. Every layer of
    a forward (and its backward) shares one row layout, so this is computed once per micro-batch, not once per
    layer. The indices live on ``device`` (the activations' device: index_copy and fancy indexing on a CUDA tensor
    need CUDA indices)."""
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    plan = []
    for group in buckets(lens):
        longest = lens[group[0]]
        src = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in group]).to(device)
        dst = torch.cat([torch.arange(lens[i]) + r * longest for r, i in enumerate(group)]).to(device)
        plan.append((len(group), longest, longest, src, dst, src, dst, None))
    return plan


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention per packed sequence. query [1, H, T, D], key / value [1, H_kv, T, D] -> [1, T, H, D].

    With :data:`PLAN` the row's attention units come from there instead of
    :data:`CU_SEQLENS`: per bucket ``(count, q_len, k_len, q_src, q_dst,
    k_src, k_dst, mask)``, the queries at rows ``q_src`` of the row attend
    the keys at rows ``k_src``, both padded (to rows ``q_dst`` / ``k_dst`` of
    ``[count, len]``), under ``mask [count, 1, q_len, k_len]`` or causally
    when it is None (shared prefixes, :mod:`areal_fsdp.prefix`).
    """
    plan = kwargs.get(PLAN)
    if plan is None:
        cu = kwargs.get(CU_SEQLENS)
        if cu is None:
            raise RuntimeError(f"{PACKED_SDPA}: the model was called without {CU_SEQLENS}; the fsdp engine passes "
                               "the packed row's sequence boundaries with every forward")
        plan = _gather_plan(tuple(cu), query.device)
    if query.shape[0] != 1:
        raise RuntimeError(f"{PACKED_SDPA}: expects one packed row, got a batch of {query.shape[0]}")
    gqa = query.shape[1] != key.shape[1]
    drop = dropout if module.training else 0.0
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    out = None  # in the dtype attention returns: bfloat16 under CUDA autocast, whatever q's own dtype
    for count, q_len, k_len, q_src, q_dst, k_src, k_dst, mask in plan:

        def padded(x: torch.Tensor, length: int, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
            flat = x.new_zeros((count * length,) + x.shape[1:]).index_copy(0, dst, x[src])
            return flat.view(count, length, *x.shape[1:]).transpose(1, 2)  # [n, heads, length, D]

        with _kernel_for(q, k_len):
            o = F.scaled_dot_product_attention(padded(q, q_len, q_src, q_dst), padded(k, k_len, k_src, k_dst),
                                               padded(v, k_len, k_src, k_dst), attn_mask=mask, dropout_p=drop,
                                               is_causal=mask is None, scale=scaling, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(count * q_len, *o.shape[1:2], o.shape[-1])
        if out is None:
            out = o.new_empty((q.shape[0],) + tuple(o.shape[1:]))
        out = out.index_copy(0, q_src, o[q_dst])
    return out[None], None


# torch's CPU flash kernel in bfloat16 / float16 is slow on short sequences: forward + backward of 16 x 56
# tokens (9 heads, 3 KV heads, head 64, 1 thread) took 36 ms against 9 ms for the plain math path, while from
# ~300 tokens flash wins (59 vs 121 ms) and in float32 it wins throughout (measured with a loop over
# sdpa_kernel(FLASH_ATTENTION / MATH) on this 2-core machine while other work ran, so roughly).
SHORT_LOW_PRECISION = 128


def _kernel_for(q: torch.Tensor, longest: int):
    if q.device.type != "cpu" or longest > SHORT_LOW_PRECISION:
        return nullcontext()
    # Under CPU autocast the kernel runs in the autocast dtype whatever q's own dtype: q and k usually reach
    # here in float32 (HF's rotary tables follow the float32 embedding output, and promotion wins), so q.dtype
    # alone sent bf16-autocast training to the slow flash kernel (6 ms vs 2 ms per layer at 16 x 31 tokens).
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    return sdpa_kernel(SDPBackend.MATH) if dtype in (torch.bfloat16, torch.float16) else nullcontext()


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    return None


def register_attention(name: str, function: Any) -> None:
    """Make ``name`` an attention transformers' ``set_attn_implementation`` accepts, running ``function`` and
    building no mask (the function gets what it needs through keywords of the model call). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, _no_mask)


def register() -> None:
    """Make :data:`PACKED_SDPA` a name transformers' ``set_attn_implementation`` accepts (idempotent)."""
    register_attention(PACKED_SDPA, packed_sdpa)


def supports(config: Any) -> bool:
    """Whether a model of ``config`` can attend per sequence: no sliding-window layers, no logit soft-capping."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
        return False
    return getattr(config, "attn_logit_softcapping", None) is None
