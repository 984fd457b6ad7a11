"""Seeded sampling for the embedded engine's generator: one token and its logprob per row of a batch of logits.

Each row has its request's ``temperature`` (0 = greedy), ``top_k``, ``top_p``
(applied in that order, as HF's logits warpers do) and ``seed``. All rows are
sampled at once (:func:`sample`): logits are divided by per-row temperatures,
top-k / top-p masks are applied to the rows that ask for them, and each row
draws its token by inverse-CDF sampling from one uniform number. For a seeded
request that number depends on the seed and on the position the token takes in
the sequence (prompt + output) only: output number ``position`` of a SplitMix64
stream whose state comes from the seed (:func:`_seeded_uniform`); unseeded
requests draw from the generator's RNG. So a seeded request draws the same
numbers whatever else is in the batch: given the same logits it samples the
same tokens alone or beside other requests. And an interrupted request,
continued from prompt + its k tokens with the same seed (by the server after a
weight update, by the rollout controller after a pause), draws for its i-th
token the number of the uninterrupted request's token k+i: the stream goes on,
so the draws after a weight swap are independent of the ones before it, and
under unchanged weights the continuation samples exactly the uninterrupted
tokens. (A ``random.Random(seed)`` per request would restart at every
continuation, handing token k+i the number of token i.)

The logits themselves depend on the batch only through rounding: in float32
(SmolLM2, 64 tokens, alone vs. in a batch of 16) logprobs agree within 2e-5
and the seeded tokens are identical; in bfloat16 the same comparison moves
logprobs by up to ~0.1 (HF ``generate`` alone vs. batched does the same) and
seeded tokens part ways after a few tokens. Same seed, same tokens across batch
compositions is a float32 property.

The logprob of each sampled token is taken, in float32, under the
distribution actually sampled from: ``log_softmax`` of ``logits /
temperature`` after the top-k / top-p masks (renormalised); for greedy rows
``log_softmax`` of the raw logits.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from areal_core.api.inference import SamplingParams

__all__ = ["sample"]

# exp() of float32 inputs below about -87 (results in the subnormal range or 0, -inf included)
# takes a slow path in torch's CPU kernel, 30-80x slower; differences from the row's max are
# clamped here first. exp(-80) ~ 1.8e-35: the mass this gives tokens that are less likely than
# that is below 1e-30 in total, and the logprob of a sampled token is computed unclamped.
_EXP_FLOOR = -80.0


_NUCLEUS_CANDIDATES = 256

# SplitMix64 (Steele, Lea & Flood 2014): its n-th output from state s is mix(s + (n + 1) * gamma), so a draw
# can be computed for any position without the ones before it.
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _seed_state(seed: int) -> int:
    """The SplitMix64 state of a request's ``seed`` (any int; mixed, so nearby seeds are far-apart streams)."""
    return _mix64(seed & _MASK64)


def _seeded_uniform(state: int, position: int) -> float:
    """The uniform number in [0, 1) of the token at sequence ``position`` of a request seeded to ``state``:
    output number ``position`` of the seed's SplitMix64 stream, computed directly (~1 us)."""
    return (_mix64((state + (position + 1) * _GAMMA) & _MASK64) >> 11) * 2.0**-53


def _nucleus(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p mask of each row of ``z`` (``[n, vocab]``, dropped tokens at -inf; ``top_p`` ``[n, 1]``).

    A token is kept when the probability of the tokens more likely than it
    is below ``top_p`` (HF drops a token when the ascending cumulative
    probability up to it is <= 1 - top_p: the same set). The more likely
    tokens are found among the top 256 (``topk``, ~15x cheaper than sorting
    49k logits); rows whose top 256 hold less than ``top_p`` are sorted whole.
    """
    n, vocab = z.shape
    top = min(_NUCLEUS_CANDIDATES, vocab)
    values, order = torch.topk(z, top, dim=-1)  # descending
    m = values[:, :1]
    total = (z - m).clamp_(min=_EXP_FLOOR).exp_().masked_fill_(z == -math.inf, 0.0).sum(-1, keepdim=True)
    p = (values - m).clamp_(min=_EXP_FLOOR).exp_().masked_fill_(values == -math.inf, 0.0).div_(total)
    before = p.cumsum(-1) - p  # probability of the more likely candidates
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, order, before < top_p)
    short = ((before[:, -1:] + p[:, -1:]) < top_p)[:, 0]  # the top candidates do not reach top_p
    if short.any():
        rows = short.nonzero()[:, 0]
        values, order = torch.sort(z[rows], dim=-1, descending=True)
        p = (values - values[:, :1]).clamp_(min=_EXP_FLOOR).exp_().masked_fill_(values == -math.inf, 0.0)
        p /= p.sum(-1, keepdim=True)
        keep[rows] = torch.zeros_like(values, dtype=torch.bool).scatter_(1, order, (p.cumsum(-1) - p) < top_p[rows])
    return keep


def sample(
    logits: torch.Tensor, params: list[SamplingParams], draws: list[Callable[[], float]]
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` (``[n, vocab]`` float32) and its logprob, all rows at once.

    Row ``i`` uses ``params[i]`` and calls ``draws[i]()`` (a uniform number in
    [0, 1)) once when it samples (temperature > 0). ``z`` is ``logits / temperature``
    (``[n, vocab]``); ``keep`` the top-k / top-p mask (``[n, vocab]`` bool, or
    None when no row asks for one); ``m`` the row max, ``e`` the unnormalised
    probabilities ``exp(z - m)`` with dropped tokens at 0, ``cdf`` their
    running sum. The token is the first column whose ``cdf`` reaches
    ``u * cdf[-1]``, ``u`` in (0, 1], so its probability is never 0; its
    logprob is ``z[token] - m - log(sum(e))``, i.e. ``log_softmax`` of the
    masked ``z``, renormalised (greedy rows: of the raw logits).
    """
    n, vocab = logits.shape
    temps = [p.temperature for p in params]
    if all(t == 0 for t in temps):
        best = logits.argmax(-1, keepdim=True)
        m = logits.amax(-1, keepdim=True)
        total = (logits - m).clamp_(min=_EXP_FLOOR).exp_().sum(-1, keepdim=True)
        logprobs = logits.gather(1, best) - m - total.log_()
        return best[:, 0].tolist(), logprobs[:, 0].tolist()

    z = logits  # never written in place
    if any(t not in (0, 1) for t in temps):
        z = logits / torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None]
    keep = None
    ks = [p.top_k if t > 0 and 0 < p.top_k < vocab else 0 for p, t in zip(params, temps)]
    if any(ks):  # top-k: keep what is >= the k-th largest (ties kept, as in HF)
        kth = torch.topk(z, max(ks), dim=-1).values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks])[:, None])
        kth.masked_fill_(torch.tensor([k == 0 for k in ks])[:, None], -math.inf)
        keep = z >= kth
    nucleus = [i for i, (p, t) in enumerate(zip(params, temps)) if t > 0 and p.top_p < 1.0]
    if nucleus:  # top-p after top-k, as HF's TopPLogitsWarper
        rows = torch.tensor(nucleus)
        sub = z[rows] if keep is None else z[rows].masked_fill(~keep[rows], -math.inf)
        kept = _nucleus(sub, torch.tensor([params[i].top_p for i in nucleus])[:, None])
        keep = torch.ones_like(z, dtype=torch.bool) if keep is None else keep
        keep[rows] &= kept
    m = z.amax(-1, keepdim=True)  # the top token is always kept
    e = torch.sub(z, m).clamp_(min=_EXP_FLOOR).exp_()
    if keep is not None:
        e.mul_(keep)
    cdf = e.cumsum(-1)
    u = torch.tensor([1.0 - draw() if t > 0 else 1.0 for draw, t in zip(draws, temps)], dtype=torch.float32)
    tokens = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).clamp_(max=vocab - 1)  # [n, 1]
    if any(t == 0 for t in temps):  # greedy rows: z is the raw logits and no mask applies
        tokens = torch.where(torch.tensor([t == 0 for t in temps])[:, None], logits.argmax(-1, keepdim=True), tokens)
    logprobs = z.gather(1, tokens) - m - e.sum(-1, keepdim=True).log_()
    return tokens[:, 0].tolist(), logprobs[:, 0].tolist()
