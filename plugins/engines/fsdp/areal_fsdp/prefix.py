"""Shared prompts computed once: the sequences of a micro-batch go through the model as a prefix tree.

An RL batch holds ``n`` samples of every prompt. Packed as separate
sequences, each sample's prompt runs through every layer again: in the demo
(a ~25-token prompt, 8 samples of 16 tokens each) 60 % of a step's tokens
are repeated prompt tokens. Causal attention makes a token's hidden states
depend only on the tokens before it, so sequences that start with the same
tokens at the same positions have the same hidden states there. Here the
micro-batch's sequences become a radix tree, each node (*segment*: tokens
shared by every sequence below it) laid out once in the row, in depth-first
order:

    row:    [ few-shot header | prompt A | sample A1 | sample A2 | prompt B | sample B1 | ... ]
    keys:     itself            header     header, A   header, A   header     header, B

A segment's tokens attend the tokens of its ancestors and, causally, their
own: exactly what each of them saw in its own sequence, so the result is
exact in the forward and the backward alike (the gradient reaching a shared
token from every sequence below it is summed by autograd, where copies would
have received it separately and the weights the sum). Token ``t`` of a
sequence is scored from the hidden state of its token ``t - 1``, wherever in
the row that now is (:attr:`SharedRow.scorer`), against its own id, so the
engine's callers see per-token values in the batch's layout as before.

Only segments that save at least :data:`MIN_SAVED` tokens are kept shared:
a shared first token (a chat template's BOS) is not worth a masked kernel.

Not a library feature: FlashAttention's varlen kernels and torch's SDPA take
one sequence per segment, and tree masks appear in speculative-decoding
code, not in a training path. The attention itself is
:func:`areal_fsdp.attention.packed_sdpa` given :func:`attention_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_core.train_batches import cumsum
from areal_fsdp.attention import PADDING_SLACK, buckets

# A node repeated by fewer tokens than this is not shared: its tokens are repeated in each child instead.
MIN_SAVED = 16


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two ``[k, n]`` tensors, compared column by column."""
    n = min(a.shape[-1], b.shape[-1])
    where = torch.nonzero((a[:, :n] != b[:, :n]).any(0))
    return int(where[0, 0]) if len(where) else n


@dataclass
class _Node:
    """Tokens ``[start, end)`` common to ``count`` sequences (read from sequence ``rep``); ``ends``: the
    sequences that stop here."""

    rep: int
    start: int
    end: int
    count: int
    ends: list[int]
    children: list["_Node"]


def _tree(rows: list[torch.Tensor], members: list[int], depth: int) -> _Node:
    """The radix tree of ``members`` (which all agree on their first ``depth`` tokens and positions)."""
    rep = members[0]
    end = depth + min(common_prefix(rows[rep][:, depth:], rows[m][:, depth:]) for m in members)
    ends, parts = [], {}
    for m in members:
        if rows[m].shape[-1] == end:
            ends.append(m)
        else:
            parts.setdefault(tuple(rows[m][:, end].tolist()), []).append(m)
    return _Node(rep, depth, end, len(members), ends, [_tree(rows, part, end) for part in parts.values()])


@dataclass
class SharedRow:
    """A micro-batch laid out as a prefix tree (see the module's docstring)."""

    input_ids: torch.Tensor     # [Tc] the row the model runs
    position_ids: torch.Tensor  # [Tc]
    scorer: torch.Tensor        # [T] row position whose hidden state scores token t of the batch (0 at starts)
    units: list[tuple[int, int]]  # per segment: (first row position, tokens)
    keys: list[torch.Tensor]    # per segment: the row positions it attends (ancestors', then its own)

    def above(self, u: int) -> int:
        """Tokens of segment ``u``'s ancestors (the keys it attends before its own)."""
        return len(self.keys[u]) - self.units[u][1]

    @property
    def saved(self) -> int:
        """Tokens the model does not run again."""
        return self.scorer.numel() - self.input_ids.numel()


def share_prefixes(input_ids: torch.Tensor, position_ids: torch.Tensor, lens: list[int],
                   min_saved: int = MIN_SAVED) -> SharedRow | None:
    """The micro-batch (``input_ids`` / ``position_ids`` [T] holding sequences of ``lens``) laid out as a
    prefix tree, or None when no segment would save ``min_saved`` tokens."""
    bounds = list(cumsum([0, *lens]))
    both = torch.stack([input_ids.to(torch.long).cpu(), position_ids.to(torch.long).cpu()])
    rows = [both[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    firsts: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        firsts.setdefault(tuple(row[:, 0].tolist()), []).append(i)
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    units: list[tuple[int, int]] = []
    keys: list[torch.Tensor] = []
    scorer = torch.zeros(bounds[-1], dtype=torch.long)
    at = 0

    def lay(node: _Node, start: int, above: list[torch.Tensor]) -> None:
        """Lay ``node`` out, its tokens from ``start`` (earlier when its parent was not worth sharing)."""
        nonlocal at
        shared = (node.count - 1) * (node.end - start) >= min_saved
        if not shared and node.children:
            # Not worth a segment of its own: its tokens go down into each child's (and each ending sequence's).
            for m in node.ends:
                lay(_Node(m, start, node.end, 1, [m], []), start, above)
            for child in node.children:
                lay(child, start, above)
            return
        here = torch.arange(at, at + node.end - start)
        ids.append(rows[node.rep][0, start:node.end])
        pos.append(rows[node.rep][1, start:node.end])
        context = torch.cat(above + [here])
        units.append((at, node.end - start))
        keys.append(context)
        at += node.end - start
        for m in node.ends:
            # Token j >= 1 of sequence m is scored from the hidden state of its token j - 1.
            scorer[bounds[m] + 1:bounds[m + 1]] = context[:-1]
        for child in node.children:
            lay(child, node.end, above + [here])

    for members in firsts.values():
        lay(_tree(rows, members, 0), 0, [])
    if at == bounds[-1]:
        return None
    return SharedRow(torch.cat(ids), torch.cat(pos), scorer, units, keys)


def attention_plan(row: SharedRow, device: torch.device | str = "cpu") -> list[tuple]:
    """Buckets for :func:`areal_fsdp.attention.packed_sdpa`.

    Segments without ancestors attend causally (no mask), bucketed by length
    as plain sequences are. Segments with ancestors attend ``[ancestors, own]``
    keys under a mask (key ``j`` is seen by query ``i`` iff ``j <= ancestors
    + i``), padded per bucket of similar sizes; padded query rows see key 0
    only, so no softmax row is empty.
    """
    plan = []
    roots = [u for u in range(len(row.units)) if row.above(u) == 0]
    lens = [row.units[u][1] for u in roots]
    for bucket in buckets(lens):
        longest = lens[bucket[0]]
        src = torch.cat([row.keys[roots[i]] for i in bucket])
        dst = torch.cat([torch.arange(lens[i]) + r * longest for r, i in enumerate(bucket)])
        plan.append((len(bucket), longest, longest, src.to(device), dst.to(device), src.to(device),
                     dst.to(device), None))
    inner = sorted((u for u in range(len(row.units)) if row.above(u) > 0),
                   key=lambda u: -len(row.keys[u]) * row.units[u][1])
    while inner:
        # A bucket grows while its padded cost stays within PADDING_SLACK of the exact one.
        take, exact = 1, row.units[inner[0]][1] * len(row.keys[inner[0]])
        while take < len(inner):
            nxt = inner[take]
            q_len = max(row.units[u][1] for u in inner[:take + 1])
            k_len = max(len(row.keys[u]) for u in inner[:take + 1])
            if (take + 1) * q_len * k_len > PADDING_SLACK * (exact + row.units[nxt][1] * len(row.keys[nxt])):
                break
            exact += row.units[nxt][1] * len(row.keys[nxt])
            take += 1
        bucket, inner = inner[:take], inner[take:]
        q_len = max(row.units[u][1] for u in bucket)
        k_len = max(len(row.keys[u]) for u in bucket)
        mask = torch.zeros(len(bucket), 1, q_len, k_len, dtype=torch.bool)
        q_src, q_dst, k_src, k_dst = [], [], [], []
        for r, u in enumerate(bucket):
            (first, n), above = row.units[u], row.above(u)
            q_src.append(torch.arange(first, first + n))
            q_dst.append(torch.arange(n) + r * q_len)
            k_src.append(row.keys[u])
            k_dst.append(torch.arange(above + n) + r * k_len)
            mask[r, 0, :n, :above + n] = torch.arange(above + n)[None, :] <= above + torch.arange(n)[:, None]
            mask[r, 0, n:, 0] = True
        plan.append((len(bucket), q_len, k_len, *(torch.cat(x).to(device) for x in (q_src, q_dst, k_src, k_dst)),
                     mask.to(device)))
    return plan


def group_units(ids: torch.Tensor, lengths: list[int], group_index: list, budget: int) -> tuple[list[list[int]],
                                                                                               list[int]]:
    """The samples of each group (``group_index``) as units a micro-batch planner places whole, so their prompt
    is shared, and each unit's cost: the tokens the model runs (the group's common prefix once). A group whose
    cost would pass ``budget`` (tokens) is cut into several units. ``ids``: the batch's packed input ids."""
    starts = list(cumsum([0] + lengths))
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_index):
        groups.setdefault(int(g), []).append(i)
    units: list[list[int]] = []
    costs: list[int] = []
    for members in groups.values():
        first = ids[starts[members[0]]:starts[members[0] + 1]]
        unit: list[int] = []
        cost = 0
        for m in members:
            common = 0 if not unit else common_prefix(first[None], ids[starts[m]:starts[m + 1]][None])
            extra = lengths[m] - common
            if unit and cost + extra > budget:
                units.append(unit)
                costs.append(cost)
                unit, cost, extra = [], 0, lengths[m]
            unit.append(m)
            cost += extra
        units.append(unit)
        costs.append(cost)
    return units, costs
