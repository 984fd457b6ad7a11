"""Rewards -> advantages on the packed batch, vectorised over sequences.

The packed layout interleaves prompt and response tokens; every function
here works on the *response grid*: ``[N, L]`` (N sequences, L = the most loss
tokens in one sequence), row i holding sequence i's loss tokens in order
(``valid`` marks the filled cells). Recursions over time (returns, GAE) then
run once per column for the whole batch. Symbols follow the papers:
r reward, G return, V value, delta TD error, A advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-6  # added to every standard deviation a normalisation divides by
MIN_STD = 1e-6  # a group's (or the batch's) std below this counts as 0: its values are divided by 1, not by eps


def std_divisor(std: torch.Tensor) -> torch.Tensor:
    """What a normalisation divides by: std + STD_EPS, or 1 where std < MIN_STD (no spread: nothing to scale).

    Dividing a spread-less group by eps alone would multiply whatever is left (float noise, an uncentred
    score) by 1e6.
    """
    return torch.where(std < MIN_STD, torch.ones_like(std), std + STD_EPS)


@dataclass
class ResponseGrid:
    """Where each sequence's loss tokens lie in the packed batch."""

    index: torch.Tensor  # [N, L] long: packed position of cell (i, k); 0 where not valid
    valid: torch.Tensor  # [N, L] bool
    lengths: torch.Tensor  # [N] long: loss tokens per sequence

    @classmethod
    def from_batch(cls, cu_seqlens: list[int], loss_mask: torch.Tensor) -> ResponseGrid:
        n = len(cu_seqlens) - 1
        seq_lens = torch.tensor([b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(n), seq_lens)  # [T]
        positions = torch.nonzero(loss_mask.bool(), as_tuple=True)[0]  # [P] loss tokens, in order
        seq = seq_of_token[positions]
        lengths = torch.bincount(seq, minlength=n)
        first = torch.cumsum(lengths, 0) - lengths  # each sequence's first row in `positions`
        col = torch.arange(len(positions)) - first[seq]
        width = int(lengths.max()) if n and len(positions) else 0
        index = torch.zeros(n, width, dtype=torch.long)
        valid = torch.zeros(n, width, dtype=torch.bool)
        index[seq, col] = positions
        valid[seq, col] = True
        return cls(index, valid, lengths)

    def gather(self, per_token: torch.Tensor) -> torch.Tensor:
        """[T] -> [N, L] (0 in invalid cells)."""
        return torch.where(self.valid, per_token[self.index], torch.zeros((), dtype=per_token.dtype))

    def scatter(self, grid: torch.Tensor, total: int) -> torch.Tensor:
        """[N, L] -> [T] (0 on tokens outside the loss mask)."""
        out = torch.zeros(total, dtype=grid.dtype)
        out[self.index[self.valid]] = grid[self.valid]
        return out

    def last(self) -> torch.Tensor:
        """[N, L] bool: the last loss token of each sequence."""
        cols = torch.arange(self.valid.shape[1])
        return self.valid & (cols[None, :] == (self.lengths - 1)[:, None])


# ---------------------------------------------------------------- rewards
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_frac: float, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per sequence ([N] floats, <= 0).

    With L_cache = buffer_frac * L_max: 0 while |y| <= L_max - L_cache, then
    ((L_max - L_cache) - |y|) / L_cache, reaching -1 at L_max (and held there
    beyond), times ``factor``.
    """
    if buffer_frac <= 0:
        return torch.zeros(len(lengths))
    cache = buffer_frac * max_len
    penalty = ((max_len - cache) - lengths.double()) / cache
    return (penalty.clamp(min=-1.0, max=0.0) * factor).float()


def shape_rewards(rewards: torch.Tensor, scale: float, bias: float, clip: float) -> torch.Tensor:
    """r <- clip((r + bias) * scale, -clip, clip); no clipping when clip is 0."""
    shaped = (rewards + bias) * scale
    return shaped.clamp(-clip, clip) if clip > 0 else shaped


# ---------------------------------------------------------------- groups
def group_stats(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence: its group's (sum, count, unbiased std) of ``values`` [N]."""
    _, group = torch.unique(group_index, return_inverse=True)
    k = int(group.max()) + 1 if len(group) else 0
    sums = torch.zeros(k, dtype=values.dtype).index_add_(0, group, values)
    counts = torch.zeros(k, dtype=values.dtype).index_add_(0, group, torch.ones_like(values))
    means = sums / counts
    squares = torch.zeros(k, dtype=values.dtype).index_add_(0, group, (values - means[group]) ** 2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))
    return sums[group], counts[group], std[group]


def normalise_groups(scores: torch.Tensor, group_index: torch.Tensor, mean: bool, std: bool) -> torch.Tensor:
    """GRPO's s_i <- (s_i - mean_g(s)) / (std_g(s) + eps) on the sequence scores [N] (see :func:`std_divisor`).

    Applied to the scores, before they become per-token rewards, so the statistics and the normalised
    quantity are the same numbers whatever the discount or KL penalty does to the per-token returns after.
    """
    sums, counts, spread = group_stats(scores, group_index)
    if mean:
        scores = scores - sums / counts
    if std:
        scores = scores / std_divisor(spread)
    return scores


def group_baseline(scores: torch.Tensor, group_index: torch.Tensor, kind: str) -> torch.Tensor:
    """b_i: the group mean of the scores, or the mean of the *other* members (leave-one-out, RLOO)."""
    sums, counts, _ = group_stats(scores, group_index)
    if kind == "group_mean":
        return sums / counts
    if kind == "leave_one_out":
        # A group of one has no other member: its baseline is 0 (the config check rejects group_size 1).
        return torch.where(counts > 1, (sums - scores) / (counts - 1).clamp(min=1), torch.zeros_like(scores))
    return torch.zeros_like(scores)


# ---------------------------------------------------------------- returns
def discounted_returns(rewards: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_k = r_k + gamma * G_{k+1} over each row's valid cells; [N, L]."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for k in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(valid[:, k], rewards[:, k] + gamma * running, running)
        returns[:, k] = running
    return returns


def gae(rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) on the response grid.

    delta_k = r_k + gamma * V_{k+1} - V_k (V after the last token is 0: the
    episode ends), A_k = delta_k + gamma * lam * A_{k+1}, returns R_k = A_k + V_k.
    """
    n, width = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(n, dtype=rewards.dtype)
    next_adv = torch.zeros(n, dtype=rewards.dtype)
    for k in range(width - 1, -1, -1):
        delta = rewards[:, k] + gamma * next_value - values[:, k]
        adv = delta + gamma * lam * next_adv
        here = valid[:, k]
        advantages[:, k] = torch.where(here, adv, torch.zeros_like(adv))
        next_value = torch.where(here, values[:, k], next_value)
        next_adv = torch.where(here, adv, next_adv)
    return advantages, advantages + values


def normalise_batch(advantages: torch.Tensor, valid: torch.Tensor, mean: bool, std: bool) -> torch.Tensor:
    """(A - mean) / (std + eps) over every loss token of the batch (unbiased std; see :func:`std_divisor`)."""
    cells = advantages[valid]
    if cells.numel() == 0:
        return advantages
    if mean:
        advantages = advantages - cells.mean()
    if std:
        spread = cells.std(unbiased=True) if cells.numel() > 1 else torch.zeros((), dtype=cells.dtype)
        advantages = advantages / std_divisor(spread)
    return torch.where(valid, advantages, torch.zeros_like(advantages))
