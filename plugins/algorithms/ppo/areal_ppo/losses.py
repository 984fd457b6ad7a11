"""Per-token policy objectives, KL estimators, behaviour weights and the value loss.

Every function takes and returns per-token tensors ``[T_mb]`` of one
micro-batch and leaves aggregation to the caller (a weighted token mean, see
:mod:`areal_ppo.algorithm`). ``u`` is the importance ratio pi_theta / pi_old
of the clipped objectives, ``A`` the advantage, ``w`` the decoupled-PPO
behaviour weight pi_prox / pi_behav.

Every log-ratio is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before it
is exponentiated (:func:`clamp_log_ratio`), as verl does: float32 ``exp``
overflows to inf above ~88.7, which makes the loss infinite or the gradient
NaN (0 * inf). Inside the bound the clamp is the identity, gradient included;
beyond it the ratio is held at e^+-20 and passes no gradient back to the
log-ratio.
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0  # e^20 = 4.85e8: far past any clip or weight bound, far below float32's max (~e^88.7)


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """log_ratio clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND], the argument of every ``exp`` here."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) from samples of pi, with x = log pi - log pi_ref.

    k1 = x; k2 = x^2 / 2; k3 = exp(-x) - 1 + x (unbiased, always >= 0), with x clamped to
    [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] (k3 only: the others exponentiate nothing).
    """
    x = logp - ref_logp
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        x = clamp_log_ratio(x)
        return torch.expm1(-x) + x
    raise ValueError(f"kl_estimator {estimator!r} is not k1, k2 or k3")


def segment_sum(values: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[T] -> [N]: the sum over each packed sequence."""
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)
    return torch.zeros(len(seq_lens), dtype=values.dtype).index_add(0, seq, values)


def broadcast(per_seq: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[N] -> [T]: each sequence's value on each of its tokens."""
    return torch.repeat_interleave(per_seq, seq_lens)


# ---------------------------------------------------------------- behaviour weight
def behaviour_weight(log_w: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor, mode: str, level: str,
                     low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's w = pi_prox / pi_behav per token, bounded; returns (w, kept) detached.

    ``level`` token: w_t = exp(log_w_t); sequence: every token of sequence i
    carries W_i = exp(sum of its loss tokens' log_w) (the sequence's
    importance weight), log_w clamped first (:func:`clamp_log_ratio`: w in
    [e^-20, e^20]). ``mode`` truncate (TIS): w <- min(max(w, low), high);
    mask (MIS): tokens (or whole sequences) with w outside [low, high] get
    weight 0 (``kept`` False); none: w as is.
    """
    log_w = torch.where(mask, log_w.detach(), torch.zeros_like(log_w))
    if level == "sequence":
        log_w = broadcast(segment_sum(log_w, seq_lens), seq_lens)
    w = torch.exp(clamp_log_ratio(log_w))
    kept = torch.ones_like(mask)
    if mode == "truncate":
        w = w.clamp(min=low, max=high)
    elif mode == "mask":
        kept = (w >= low) & (w <= high)
        w = torch.where(kept, w, torch.zeros_like(w))
    return w, kept


# ---------------------------------------------------------------- policy objectives
def clipped_surrogate(u: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: -min(u A, clip(u, 1 - low, 1 + high) A); returns (loss, clipped), clipped where the clip binds."""
    unclipped = u * adv
    clipped = u.clamp(1.0 - low, 1.0 + high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def sequence_ratio(log_u: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """GSPO's s_i = exp(mean over sequence i's loss tokens of log u) (mean clamped), broadcast to its tokens."""
    masked = torch.where(mask, log_u, torch.zeros_like(log_u))
    count = segment_sum(mask.to(log_u.dtype), seq_lens).clamp(min=1.0)
    return broadcast(torch.exp(clamp_log_ratio(segment_sum(masked, seq_lens) / count)), seq_lens)


def soft_gate(u: torch.Tensor, adv: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO: -f(u) A with f(u) = sigmoid(tau (u - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg.

    f'(1) = 1, so near u = 1 the gradient is the policy gradient; far from it
    the gate fades smoothly instead of cutting off. The value is shifted by
    the constant 1 - f(1) = 1 - 2 / tau (no effect on the gradient) so that,
    like every other objective here, the loss is -A at u = 1.
    """
    tau = torch.where(adv > 0, torch.full_like(u, tau_pos), torch.full_like(u, tau_neg))
    return -(torch.sigmoid(tau * (u - 1.0)) * (4.0 / tau) + 1.0 - 2.0 / tau) * adv


def clipped_is_weight(logp: torch.Tensor, u: torch.Tensor, adv: torch.Tensor, low: float,
                      high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: gradient -sg(clip(u, 1 - low, 1 + high)) A grad log pi; every token keeps a gradient.

    Written as -sg(c A) (1 + log pi - sg(log pi)) so that the loss's value is
    -c A (and -A at u = 1) while its gradient is the CISPO one.
    """
    c = u.detach().clamp(1.0 - low, 1.0 + high)
    return -(c * adv).detach() * (1.0 + logp - logp.detach()), c != u.detach()


def m2_mask(log_r: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO: drop the tokens with the largest (log r)^2 until the mean over the rest is <= threshold.

    ``log_r`` [P]: log pi_prox - log pi_behav over the batch's loss tokens.
    Returns [P] bool, True = kept. Sorting once makes it exact: keeping the
    k smallest second moments, k is the largest with mean <= threshold.
    """
    m2 = log_r.double() ** 2
    ordered, order = torch.sort(m2)
    means = torch.cumsum(ordered, 0) / torch.arange(1, len(m2) + 1, dtype=m2.dtype)
    fits = torch.nonzero(means <= threshold, as_tuple=True)[0]
    keep_count = int(fits.max()) + 1 if len(fits) else 0
    kept = torch.zeros(len(m2), dtype=torch.bool)
    kept[order[:keep_count]] = True
    return kept


# ---------------------------------------------------------------- critic
def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> torch.Tensor:
    """1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); plain 1/2 (V - R)^2 when c is 0."""
    plain = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns) ** 2)
