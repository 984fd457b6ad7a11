"""The embedded engine's KV cache: :class:`SlotCache`, preallocated buffers in which every running request owns a row.

The :class:`~areal_local.generator.Generator` hands it to the HF model as
``past_key_values`` and, before each forward, plans which rows and columns the
new K/V go to; ``update`` (called by every attention layer) writes them there.
:mod:`areal_local.lean_decode` writes and reads the same buffers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

__all__ = ["SlotCache"]


class SlotCache(Cache):
    """KV cache of a batch whose rows start and end at their own columns.

    Per layer, ``keys`` / ``values`` are ``[rows, kv_heads, columns, head_dim]``
    buffers, allocated at the first write with the capacity set by
    :meth:`reserve`. Before each forward the owner says where the new K/V go:
    :meth:`plan_prefill` (rows ``r0 .. r0+n-1``, columns ``0 .. P-1``) or
    :meth:`plan_decode` (rows ``0 .. B-1``, one column per row). ``update``
    writes there and returns the window the attention reads
    (the owner's mask hides what a row must not see).
    """

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.rows = 0
        self.columns = 0
        self._plan: tuple = ("none",)
        self._flat: tuple | None = None
        self._length = 0

    # -- capacity ---------------------------------------------------------
    def reserve(self, rows: int, columns: int, max_rows: int, max_columns: int) -> None:
        """Make room for ``rows`` x ``columns``; existing contents are kept.

        Growth doubles (rows up to ``max_rows``, columns up to ``max_columns``,
        what the running requests can reach), so copies are rare.
        """
        if rows <= self.rows and columns <= self.columns:
            return
        new_rows = self.rows if rows <= self.rows else min(max_rows, max(rows, 2 * self.rows))
        new_cols = self.columns
        if columns > self.columns:
            new_cols = max(columns, min(max_columns, -(-max(2 * self.columns, columns + 64) // 64) * 64))
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                if old is None:
                    continue
                grown = old.new_zeros((new_rows, old.shape[1], new_cols, old.shape[3]))
                grown[: old.shape[0], :, : old.shape[2]] = old
                store[i] = grown
        self.rows, self.columns = new_rows, new_cols

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A layer's zeroed K or V buffer at the reserved capacity, for states shaped like ``like`` [., heads,
        ., dim]."""
        return like.new_zeros((self.rows, like.shape[1], self.columns, like.shape[3]))

    def clear(self) -> None:
        """Drop every buffer (memory is returned; the next write allocates again)."""
        self.keys, self.values = [], []
        self.rows = self.columns = 0
        self._plan = ("none",)

    def move_row(self, src: int, dst: int, columns: int) -> None:
        """Copy row ``src``'s first ``columns`` columns onto row ``dst``."""
        for store in (self.keys, self.values):
            for buf in store:
                if buf is not None:
                    buf[dst, :, :columns] = buf[src, :, :columns]

    def copy_rows(self, first: int, source: list[int], columns: int) -> None:
        """Rows ``first + j`` become copies of rows ``first + source[j]`` (first ``columns`` columns)."""
        src = torch.tensor(source) + first
        for store in (self.keys, self.values):
            for buf in store:
                if buf is not None:
                    buf[first:first + len(source), :, :columns] = buf[src, :, :columns]  # gathers before writing

    # -- what the next forward writes -----------------------------------------
    def plan_prefill(self, first_row: int, n: int, length: int, first_column: int = 0) -> None:
        """Rows ``first_row .. first_row + n - 1`` write columns ``first_column .. length - 1``; attention
        reads columns ``0 .. length - 1`` (what lies before ``first_column`` was placed there already)."""
        self._plan = ("prefill", first_row, n, length, first_column)
        self._length = length

    def place(self, prefix: SlotCache, first: int, offsets: list[int], columns: int) -> None:
        """Row ``first + j`` gets ``prefix``'s row 0 (its first ``columns`` columns) at columns
        ``offsets[j] ..``: a prompt prefix computed once, placed where each row's copy of it lies."""
        for store, source in ((self.keys, prefix.keys), (self.values, prefix.values)):
            while len(store) < len(source):
                store.append(None)
            for i, src in enumerate(source):
                if store[i] is None:
                    store[i] = self._buffer(src)
                for j, offset in enumerate(offsets):
                    store[i][first + j, :, offset:offset + columns] = src[0, :, :columns]

    def plan_decode(self, n: int, columns: torch.Tensor, length: int) -> None:
        """Row ``i`` (of ``0 .. n-1``) writes at column ``columns[i]``; attention reads ``length`` columns."""
        self._plan = ("decode", torch.arange(n), columns, n, length)
        self._flat = None
        self._length = length

    # -- the HF Cache interface -------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None:
            keys = self.keys[layer_idx] = self._buffer(key_states)
            values = self.values[layer_idx] = self._buffer(value_states)
        plan = self._plan
        if plan[0] == "decode":
            _, rows, cols, n, length = plan
            # Row r's new K/V go to column cols[r] of every head: flat row (r * heads + h) * columns + cols[r]
            # of the buffer seen as [rows * heads * columns, head_dim]. index_copy_ on that view is much
            # faster than the equivalent advanced-index assignment.
            flat = self._decode_index(keys.shape[1], keys.shape[2])
            keys.view(-1, keys.shape[3]).index_copy_(0, flat, key_states[:, :, 0].reshape(-1, keys.shape[3]))
            values.view(-1, values.shape[3]).index_copy_(0, flat, value_states[:, :, 0].reshape(-1, values.shape[3]))
            return keys[:n, :, :length], values[:n, :, :length]
        if plan[0] == "prefill":
            _, r0, n, length, c0 = plan
            keys[r0 : r0 + n, :, c0:length] = key_states
            values[r0 : r0 + n, :, c0:length] = value_states
            return keys[r0 : r0 + n, :, :length], values[r0 : r0 + n, :, :length]
        raise RuntimeError("SlotCache.update called without a plan; the Generator sets one before each forward")

    def _decode_index(self, heads: int, columns: int) -> torch.Tensor:
        """The flat rows the decode plan writes, computed once per step (every layer shares them)."""
        _, rows, cols, _, _ = self._plan
        if self._flat is None or self._flat[0] != (heads, columns):  # plan_decode resets it
            flat = ((rows[:, None] * heads + torch.arange(heads)[None, :]) * columns + cols[:, None]).reshape(-1)
            self._flat = ((heads, columns), flat)
        return self._flat[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length

    def get_max_length(self) -> int:
        return -1

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def is_compileable(self) -> bool:
        return False
