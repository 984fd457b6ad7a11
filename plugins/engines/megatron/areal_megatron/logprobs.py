"""Per-token logprobs and entropy from vocab-parallel logits, never gathering the vocabulary.

Under tensor parallelism each rank holds the logits of its slice of the
(padded) vocabulary, ``[T, V'/t]``. For every position (float32, logits
divided by the temperature ``tau``, padded columns excluded):

    m    = max over all ranks of the local maxima          (all-reduce MAX, no grad)
    S    = sum over ranks of sum_v exp(l_v - m)            (all-reduce SUM)
    lse  = m + log S
    logp = l_label - lse      (l_label from the rank that holds it, 0 elsewhere; all-reduce SUM)
    H    = lse - (sum over ranks of sum_v exp(l_v - m) l_v) / S

The sums use Megatron's ``reduce_from_tensor_model_parallel_region``: an
all-reduce forward and the identity backward, since every rank of the group
goes on with the same replicated value and back-propagates it itself; the
output layer's input copy (``copy_to_tensor_model_parallel_region``)
all-reduces the gradient on the way back.

A packed row holds several sequences: ``logp_t`` is read from position
``t - 1`` and is 0 at each sequence's first token (``is_start``), like the
fsdp engine's :func:`areal_fsdp.logprobs.token_logprobs`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the tensor-parallel group: all-reduce forward, identity backward (no group: ``x``)."""
    if group is None:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, is_start: torch.Tensor, *,
                            vocab_start: int, vocab_size: int, temperature: float = 1.0,
                            tp_group: dist.ProcessGroup | None = None, chunk: int = 1024,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(logprobs [T], entropy [T])`` of ``input_ids`` [T] from this rank's logits ``[T, V_local]``.

    ``vocab_start``: the global id of local column 0; ``vocab_size``: the
    true vocabulary (columns at or past it are padding); ``tp_group``: the
    tensor-parallel group, None for a single rank.
    """
    if temperature <= 0:
        raise ValueError(f"vocab_parallel_logprobs: temperature must be > 0, got {temperature}")
    local = logits.shape[-1]
    columns = torch.arange(vocab_start, vocab_start + local, device=logits.device)
    valid = columns < vocab_size
    labels = input_ids[1:]
    parts_lp, parts_ent = [], []
    for s in range(0, logits.shape[0] - 1, chunk):
        lg = logits[s:min(s + chunk, logits.shape[0] - 1)].float() / temperature
        lg = lg.masked_fill(~valid, float("-inf"))
        lab = labels[s:s + lg.shape[0]]
        m = lg.detach().max(dim=-1).values
        if tp_group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        shifted = lg - m[:, None]
        e = shifted.exp()
        mine = (lab >= vocab_start) & (lab < vocab_start + local)
        picked = shifted.gather(-1, (lab - vocab_start).clamp(0, local - 1)[:, None]).squeeze(-1)
        picked = torch.where(mine, picked, 0.0)
        weighted = torch.where(valid, e * shifted, 0.0).sum(-1)
        total = _tp_sum(torch.stack([e.sum(-1), picked, weighted]), tp_group)
        log_s = total[0].log()
        parts_lp.append(total[1] - log_s)
        parts_ent.append(log_s - total[2] / total[0])
    zero = logits.new_zeros(1, dtype=torch.float32)
    logp = torch.cat([zero, *parts_lp])
    entropy = torch.cat([zero, *parts_ent])
    keep = ~is_start
    return torch.where(keep, logp, 0.0), torch.where(keep, entropy, 0.0)
