"""Per-token logprobs and entropy of packed sequences, from hidden states, a chunk at a time.

A micro-batch is ONE row of ``T`` tokens holding several sequences back to
back. Two pieces make that row behave like separate sequences:

- :func:`packed_attention_mask`: a block-diagonal causal mask ``[1, 1, T, T]``
  (token ``q`` sees token ``k`` iff both lie in the same sequence and
  ``k <= q``); boolean for ``sdpa`` (True = attend), additive float for
  ``eager`` (0 or the dtype's minimum). transformers hands a 4D mask to the
  attention as it is.
- position ids that restart at 0 per sequence (the batch carries them).

:func:`token_logprobs` turns the last hidden states ``h`` [T, H] into

    logp_t = log softmax(W h_{t-1} / tau)[x_t]      (tau = temperature)
    H_t    = -sum_v p_v log p_v  of that same distribution

for every token ``t`` but the first of each sequence, which gets 0.0
(:func:`next_token_logprobs` is the same with the targets given per
position, for rows whose positions are not contiguous). The
logits are computed in float32 ``chunk`` positions at a time; with grad each
chunk runs under activation checkpointing, so only ``h`` is kept and the
[chunk, V] float32 logits are recomputed in backward: the full-vocabulary
logits of the whole micro-batch never exist at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def sequence_ids(seq_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[T] index of the sequence each token belongs to."""
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)


def packed_attention_mask(seq_lens: list[int], *, additive_dtype: torch.dtype | None = None,
                          device: torch.device | str = "cpu", sliding_window: int | None = None) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` of sequences of ``seq_lens`` packed in one row.

    Boolean (True = attend) unless ``additive_dtype`` is given: then 0 where
    attended and ``finfo(additive_dtype).min`` elsewhere. ``sliding_window``
    also hides keys ``sliding_window`` or more positions back.
    """
    seq = sequence_ids(seq_lens, device)
    pos = torch.arange(seq.numel(), device=device)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    mask = mask[None, None]
    if additive_dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=additive_dtype, device=device).masked_fill_(
        ~mask, torch.finfo(additive_dtype).min)


def _chunk_logprobs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    temperature: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [n] and entropy [n] of ``labels`` [n] under ``softmax(linear(h) / temperature)`` in float32."""
    logits = F.linear(h, weight, bias).float()  # [n, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_ids: torch.Tensor,
                   is_start: torch.Tensor, *, temperature: float = 1.0, chunk: int = 1024,
                   softcap: float | None = None, only: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(logprobs [T], entropy [T])`` of ``input_ids`` [T] from ``hidden`` [T, H].

    ``is_start`` [T] marks the first token of each sequence (value 0.0 there).
    ``weight`` [V, H] / ``bias`` [V]: the output projection. Under grad each
    chunk is checkpointed (recomputed in backward). ``only`` [T] bool: compute
    just those tokens (the loss tokens, during training) and leave 0.0
    elsewhere: in an RL batch most tokens are prompt, and the vocabulary-wide
    float32 work (projection, log-sum-exp, entropy) is the larger part of a
    step for a small model.
    """
    wanted = ~is_start
    if only is not None:
        wanted = wanted & only.bool()
    # Token t is scored from h_{t-1}: position p of the shifted row scores token p + 1.
    logp, entropy = next_token_logprobs(hidden[:-1], weight, bias, input_ids[1:], wanted[1:],
                                        temperature=temperature, chunk=chunk, softcap=softcap)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def next_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        targets: torch.Tensor, wanted: torch.Tensor, *, temperature: float = 1.0, chunk: int = 1024,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(logprobs [n], entropy [n])``: position ``p`` scores ``targets[p]`` under ``h_p``; 0.0 where
    ``wanted`` [n] is False.

    The positions need not be contiguous: context parallel passes a rank's
    share of a row with each token's target taken from the whole row.
    """
    if temperature <= 0:
        raise ValueError(f"next_token_logprobs: temperature must be > 0, got {temperature}")
    n = hidden.shape[0]
    positions = torch.nonzero(wanted, as_tuple=True)[0]
    pred, labels = hidden[positions], targets[positions]
    pieces_lp, pieces_ent = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, len(positions), chunk):
        args = (pred[s:s + chunk], weight, bias, labels[s:s + chunk], temperature, softcap)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)
        pieces_lp.append(lp)
        pieces_ent.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logp = hidden.new_zeros(n, dtype=torch.float32).index_put((positions,), torch.cat([empty, *pieces_lp]))
    entropy = hidden.new_zeros(n, dtype=torch.float32).index_put((positions,), torch.cat([empty, *pieces_ent]))
    return logp, entropy
