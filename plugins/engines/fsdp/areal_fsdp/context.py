"""Context parallel by all-gathered keys and values: each of ``c`` ranks holds a share of every packed row.

The ``c`` ranks of one context group run the same micro-batches. A row of
``T`` tokens is padded to ``T'`` (a multiple of ``2c``) and cut into ``2c``
equal chunks; cp rank ``r`` keeps chunks ``r`` and ``2c - 1 - r``, so under a
causal mask every rank has the same amount of work (an early chunk with few
keys, a late one with many):

    c = 2, T' = 8:   chunks  [0 1][2 3][4 5][6 7]
                     rank 0:  0 1              6 7
                     rank 1:        2 3   4 5

Every layer runs on the local tokens only, except attention, which needs all
keys: :func:`cp_sdpa` all-gathers K and V over the group (its backward
reduce-scatters their gradients back to the ranks that own the tokens), puts
them in row order, and attends the local queries to them under a mask built
from global token indices and sequence ids: causal AND same sequence. This is
the variant Llama 3 training and Megatron use; it needs an all-gather only, no
ring kernel, so it runs under gloo as under nccl. Each rank computes
``T'/c x T'`` scores: the mask is dense, so the per-sequence saving of
:mod:`areal_fsdp.attention` is not had here.

transformers routes attention through ``AttentionInterface``; :func:`register`
adds :func:`cp_sdpa` as :data:`CP_SDPA`, and the engine passes the
micro-batch's :class:`ContextShard` as the :data:`SHARD` keyword of the model
call, which transformers forwards to every attention layer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch
import torch.nn.functional as F

CP_SDPA = "areal_cp_sdpa"
SHARD = "areal_cp_shard"


def padded_length(tokens: int, size: int) -> int:
    """The row length ``T'``: ``tokens`` rounded up to a multiple of ``2 * size``."""
    step = 2 * size
    return -(-tokens // step) * step


@lru_cache(maxsize=32)
def local_index(length: int, size: int, rank: int) -> torch.Tensor:
    """[2 * length / (2 size)] row positions of cp rank ``rank``'s tokens: chunks ``rank`` and ``2 size - 1 - rank``."""
    if length % (2 * size):
        raise ValueError(f"local_index: a row of {length} tokens cannot be cut into 2 x {size} equal chunks; pad it "
                         f"to padded_length() first")
    n = length // (2 * size)
    return torch.cat([torch.arange(rank * n, (rank + 1) * n),
                      torch.arange((2 * size - 1 - rank) * n, (2 * size - rank) * n)])


@lru_cache(maxsize=32)
def _row_order(length: int, size: int) -> torch.Tensor:
    """[length] where row position ``g`` lies in the rank-by-rank concatenation of every rank's tokens."""
    return torch.argsort(torch.cat([local_index(length, size, r) for r in range(size)]))


Gather = Callable[[torch.Tensor, int], torch.Tensor]


class ContextShard:
    """One cp rank's share of one padded row: which tokens, their attention mask, and how to gather a row.

    ``seq_ids`` [T'] is the sequence each row position belongs to (padding
    gets an id of its own, so no real token attends to it). ``gather(x, dim)``
    concatenates every rank's ``x`` along ``dim`` in rank order; by default
    the autograd-aware all-gather over ``group``; tests pass their own.
    """

    def __init__(self, seq_ids: torch.Tensor, size: int, rank: int, group: Any = None,
                 gather: Gather | None = None) -> None:
        length = seq_ids.shape[0]
        device = seq_ids.device
        self.size, self.rank, self.length, self.group = size, rank, length, group
        self.index = local_index(length, size, rank).to(device)  # [T'/c] row positions held here
        self._order = _row_order(length, size).to(device)
        self._gather = gather or self._all_gather
        keys = torch.arange(length, device=device)
        # [1, 1, T'/c, T'] True = attend: key not after the query, and in the query's sequence.
        self.mask = ((keys[None, :] <= self.index[:, None])
                     & (seq_ids[None, :] == seq_ids[self.index][:, None]))[None, None]

    def split(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of ``x`` (a whole padded row along ``dim``)."""
        return x.index_select(dim, self.index)

    def gather_row(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's tokens of ``x`` (this rank's share along ``dim``) as the whole padded row, in row order.

        Differentiable: the gradient of each row position flows back to the rank that holds it.
        """
        return self._gather(x, dim).index_select(dim, self._order)

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        from torch.distributed import _functional_collectives as fc

        # The functional, autograd-aware all-gather: its backward reduce-scatters (sums) the gradients. Recent
        # torch names it all_gather_single_autograd (the old name warns on every call); older torch has the old one.
        gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
        return gather(x.contiguous(), dim, self.group)


def cp_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Local queries [1, H, T'/c, D] against the gathered keys / values [1, H_kv, T', D] -> [1, T'/c, H, D]."""
    shard = kwargs.get(SHARD)
    if not isinstance(shard, ContextShard):
        raise RuntimeError(f"{CP_SDPA}: the model was called without {SHARD}; the fsdp engine passes the row's "
                           "context-parallel shard with every forward")
    if query.shape[0] != 1:
        raise RuntimeError(f"{CP_SDPA}: expects one packed row, got a batch of {query.shape[0]}")
    keys, values = shard.gather_row(key, 2), shard.gather_row(value, 2)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=shard.mask,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None


def register() -> None:
    """Make :data:`CP_SDPA` a name transformers' ``set_attn_implementation`` accepts (idempotent)."""
    from areal_fsdp.attention import register_attention

    register_attention(CP_SDPA, cp_sdpa)
