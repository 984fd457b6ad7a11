"""Which sequences of a packed batch each data-parallel rank and micro-batch takes.

Pure Python (no torch): lengths in, lists of sequence indices out, the same on
every rank for the same batch.

- :func:`rank_micro_batches`: the whole plan of one data-parallel rank (its
  share of the batch, cut into as many micro-batches as the busiest rank
  needs); what a train engine calls.

- :func:`karmarkar_karp`: a k-way partition with balanced token sums (the
  largest differencing method); used to share sequences among ranks and to
  spread a rank's sequences over its micro-batches.
- :func:`first_fit_decreasing`: the fewest micro-batches under a token budget
  (what decides how many micro-batches a rank needs).
- :func:`micro_batches`: exactly ``k`` micro-batches under the budget, as
  balanced as the budget allows.

A sequence longer than the budget gets a micro-batch of its own (it is never
cut: attention needs the whole sequence).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indices, each summing to at most ``capacity`` (or holding one longer sequence)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def karmarkar_karp(lengths: list[int], k: int) -> list[list[int]]:
    """``k`` lists of sequence indices whose length sums are balanced (some empty when fewer than ``k``).

    Largest differencing method: every item starts as a k-tuple of subsets
    (itself and k-1 empty ones); the two tuples with the largest spread
    (max - min sum) are merged, largest subset of one with the smallest of the
    other, until one tuple is left. Deterministic: ties break by creation order.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be at least 1, got {k}")
    if k == 1:
        return [list(range(len(lengths)))]
    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, n in enumerate(lengths):
        parts = [(n, [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-n, next(counter), parts))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])
        b = sorted(b, key=lambda p: p[0])
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)), key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    return [sorted(indices) for _, indices in heap[0][2]]


def micro_batches(lengths: list[int], capacity: int, k: int) -> list[list[int]]:
    """Exactly ``k`` micro-batches (lists of indices into ``lengths``) under the token budget ``capacity``.

    ``k`` must be at least ``len(first_fit_decreasing(lengths, capacity))``.
    The balanced k-way partition is used when it respects the budget;
    otherwise the first-fit-decreasing bins are split, largest first, until
    there are ``k``. Micro-batches are empty only when there are fewer
    sequences than ``k``.
    """
    def load(b: list[int]) -> int:
        return sum(lengths[i] for i in b)

    bins = karmarkar_karp(lengths, k)
    if all(load(b) <= capacity or len(b) == 1 for b in bins):
        return _ordered(bins)
    bins = first_fit_decreasing(lengths, capacity)
    if len(bins) > k:
        raise ValueError(f"micro_batches: {len(lengths)} sequences need {len(bins)} micro-batches of at most "
                         f"{capacity} tokens, more than the {k} asked for")
    while len(bins) < k:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        biggest = max(splittable, key=load)
        bins.remove(biggest)
        halves = karmarkar_karp([lengths[i] for i in biggest], 2)
        bins.extend([biggest[j] for j in half] for half in halves)
    return _ordered(bins)


def _ordered(bins: list[list[int]]) -> list[list[int]]:
    """Non-empty bins first, each by first index; the order is deterministic."""
    return sorted((sorted(b) for b in bins), key=lambda b: (not b, b[0] if b else 0))


def rank_micro_batches(costs: list[int], capacity: int, *, dp: int = 1, dp_rank: int = 0,
                       agree: Callable[[int], int] = lambda count: count, multiple_of: int = 1) -> list[list[int]]:
    """The micro-batches (lists of indices into ``costs``) of data-parallel rank ``dp_rank`` of ``dp``.

    The ranks share the items by :func:`karmarkar_karp` over ``costs`` (token counts); each rank needs
    :func:`first_fit_decreasing` many micro-batches under ``capacity`` and every rank runs the same count:
    ``agree(count)`` returns the largest over the ranks (an all-reduce MAX; the identity on one rank),
    rounded up to a multiple of ``multiple_of`` (an interleaved pipeline runs micro-batches in groups of
    its stage count). A rank short of items gets empty micro-batches (weight-0 fillers that still take part
    in the collectives). At least one micro-batch, even for an empty rank.
    """
    if not costs:
        raise ValueError("rank_micro_batches: the batch holds no sequences")
    mine = karmarkar_karp(costs, dp)[dp_rank] if dp > 1 else list(range(len(costs)))
    own = [costs[i] for i in mine]
    count = max(1, agree(len(first_fit_decreasing(own, capacity))))
    count = -(-count // multiple_of) * multiple_of
    bins = micro_batches(own, capacity, count) if own else [[] for _ in range(count)]
    return [[mine[j] for j in b] for b in bins]


def buckets(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, in consecutive groups of at most ``capacity`` (bytes); an item larger
    than that is a group alone. How weights are cut into transfer buckets."""
    if capacity < 1:
        raise ValueError(f"buckets: the bucket size must be >= 1 byte, got {capacity}")
    out: list[list[int]] = []
    load = 0
    for i, size in enumerate(sizes):
        if not out or load + size > capacity:
            out.append([])
            load = 0
        out[-1].append(i)
        load += size
    return out
