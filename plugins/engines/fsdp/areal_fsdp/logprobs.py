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
logits are computed in float32 ``chunk`` positions at a time, and with grad
only ``h`` and two floats per position are kept: the [chunk, V] logits are
recomputed in backward, so the full-vocabulary logits of the whole
micro-batch never exist at once.

With grad, a chunk goes through :class:`VocabLogprobs`, whose backward is
written out (below) instead of being autograd's trace of the forward. For a
small model this vocabulary-wide float32 work is a large share of a train
step, and autograd's version of it (a checkpointed chunk: the forward run
twice, then the backward of logsumexp, softmax, product and sum, each a
pass over [chunk, V]) made ~25 passes over the logits where this makes ~12.
With ``z = logits / tau``, ``lse = logsumexp(z)``, ``p = exp(z - lse)`` and
``E[z] = sum_v p_v z_v = lse - H``:

    d logp / dz = onehot(x) - p
    d H / dz    = -p * (z - E[z])

so ``dL/dz = g_lp * onehot(x) - p * (g_lp + g_H * (z - E[z]))``. A model
with soft-capped logits (Gemma 2) keeps the autograd path.
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
    """logp [n] and entropy [n] of ``labels`` [n] under ``softmax(linear(h) / temperature)`` in float32, by
    autograd's ops (soft-capped models, and the reference :class:`VocabLogprobs` is tested against)."""
    logits = F.linear(h, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [n, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the output projection runs in: autocast's where it is on, else the weight's."""
    kind = weight.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def _projection(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                inv_temp: float) -> torch.Tensor:
    """``z = (h W^T + b) / tau`` in float32 (float64 stays so) [n, V], the matmul in ``h``'s dtype (the caller
    casts)."""
    with torch.autocast(weight.device.type, enabled=False):
        z = F.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def _lse_and_mean(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp(z), E_p[z])`` per row of ``z`` [n, V], ``p = softmax(z)``; ``z`` is left as it was."""
    top = z.amax(-1, keepdim=True)
    e = torch.sub(z, top).exp_()
    total = e.sum(-1)
    with torch.autocast(z.device.type, enabled=False):  # CPU autocast runs vecdot in bf16
        mean = torch.linalg.vecdot(e, z) / total  # sum_v e_v z_v without an [n, V] product
    return top.squeeze(-1) + total.log(), mean


class VocabLogprobs(torch.autograd.Function):
    """``(logp [n], entropy [n])`` of ``labels`` [n] under ``softmax((h W^T + b) / tau)``; see the module text.

    The projection runs in the compute dtype (autocast's, or the weight's);
    everything over the vocabulary is float32. Saved for backward: ``h`` and
    the weight cast to the compute dtype (so backward does not cast it again),
    ``labels``, ``lse`` and ``E[z]``.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, labels, inv_temp):
        dtype = _compute_dtype(weight)
        hc, wc = h.to(dtype), weight.to(dtype)
        bc = bias.to(dtype) if bias is not None else None
        z = _projection(hc, wc, bc, inv_temp)
        lse, mean = _lse_and_mean(z)
        logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
        ctx.save_for_backward(hc, wc, bc, labels, lse, mean)
        ctx.inv_temp = inv_temp
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)  # entropy often feeds only the stats: skip its term then
        return logp, lse - mean

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hc, wc, bc, labels, lse, mean = ctx.saved_tensors
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None
        z = _projection(hc, wc, bc, ctx.inv_temp)
        p = torch.sub(z, lse[:, None]).exp_()
        # dL/dz = g_lp * onehot - p * (g_lp + g_H * (z - E[z])), built in z's buffer.
        if g_entropy is not None:
            grad = z.sub_(mean[:, None]).mul_(g_entropy[:, None])
            if g_logp is not None:
                grad.add_(g_logp[:, None])
        else:
            grad = z.copy_(g_logp[:, None].expand_as(z))
        grad.mul_(p).neg_()
        if g_logp is not None:
            grad.scatter_add_(-1, labels[:, None], g_logp[:, None])
        if ctx.inv_temp != 1.0:
            grad.mul_(ctx.inv_temp)
        gc = grad.to(hc.dtype)
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        g_h = (gc @ wc).to(h_dtype) if ctx.needs_input_grad[0] else None
        g_w = (gc.t() @ hc).to(w_dtype) if ctx.needs_input_grad[1] else None
        g_b = grad.sum(0).to(b_dtype) if bc is not None and ctx.needs_input_grad[2] else None
        return g_h, g_w, g_b, None, None


def _chunk_values(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  temperature: float, softcap: float | None, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if softcap is not None:
        args = (h, weight, bias, labels, temperature, softcap)
        return checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)
    if grad:
        return VocabLogprobs.apply(h, weight, bias, labels, 1.0 / temperature)
    dtype = _compute_dtype(weight)
    z = _projection(h.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None, 1.0 / temperature)
    lse, mean = _lse_and_mean(z)
    return z.gather(-1, labels[:, None]).squeeze(-1) - lse, lse - mean


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
        lp, ent = _chunk_values(pred[s:s + chunk], weight, bias, labels[s:s + chunk], temperature, softcap, grad)
        pieces_lp.append(lp)
        pieces_ent.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logp = hidden.new_zeros(n, dtype=torch.float32).index_put((positions,), torch.cat([empty, *pieces_lp]))
    entropy = hidden.new_zeros(n, dtype=torch.float32).index_put((positions,), torch.cat([empty, *pieces_ent]))
    return logp, entropy
