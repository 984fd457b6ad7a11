"""Helpers every train engine needs for the packed batch the trainer hands it.

The trainer's batch (:mod:`areal_core.api.train`) arrives as lists or
tensors; an engine turns it into CPU tensors (:func:`to_tensor`), slices
micro-batches, and after the step reports the batch's token-mean loss and the
loss callback's statistics weighted by each micro-batch's loss tokens
(:func:`scalar_stats`, :func:`combine_stats`). Engine-neutral, so the fsdp and
megatron engines (and third-party ones) share one copy. torch is imported on
first use, never when ``areal_core`` is.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator


def as_list(value: Any) -> list:
    """A tensor or sequence as a plain list."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def to_tensor(key: str, value: Any) -> Any:
    """Lists of numbers as CPU tensors: ``loss_mask`` bool, floats float32, ints int64; anything else as is."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    elif isinstance(value, (list, tuple)) and (not value or isinstance(value[0], (int, float, bool))):
        # A flat list of numbers, through numpy: 4x faster than torch.tensor on a list (0.08 against 0.35 s for
        # 2M ints), and numpy's dtype says whether every element was a number (checking each one in Python first
        # cost more than the conversion, on batches of millions of tokens).
        import numpy

        try:
            array = numpy.array(value)
        except (TypeError, ValueError):  # ragged
            return value
        if array.ndim != 1 or array.dtype.kind not in "biuf":
            return value
        t = torch.from_numpy(array)
    else:
        return value
    if key == "loss_mask":
        return t.bool()
    if t.is_floating_point():
        return t.float()
    return t.long() if t.dtype != torch.bool else t


def cumsum(values: Iterable[int]) -> Iterator[int]:
    """Running totals: 3, 4, 2 -> 3, 7, 9."""
    total = 0
    for v in values:
        total += v
        yield total


def scalar_stats(stats: Any) -> dict[str, float]:
    """The loss callback's stats that are single numbers (one-element tensors included), as floats."""
    out: dict[str, float] = {}
    for key, value in (stats or {}).items():
        try:
            out[key] = float(value.detach()) if hasattr(value, "detach") else float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out


def combine_stats(records: list[tuple[int, float, dict]], total_loss_tokens: int) -> dict[str, float]:
    """``records``: (loss tokens, token-mean loss, scalar stats) per micro-batch.

    Returns the batch's token-mean ``loss`` and each stat's mean weighted by
    the loss tokens of the micro-batches that reported it, so the figures do
    not depend on how the batch was split.
    """
    out: dict[str, float] = {"loss": sum(n * loss for n, loss, _ in records) / max(1, total_loss_tokens)}
    sums: dict[str, list[float]] = {}
    for n, _, stats in records:
        for key, value in stats.items():
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += n * value
            acc[1] += n
    out.update({k: s / max(1.0, w) for k, (s, w) in sums.items() if k not in out})
    return out


# ---------------------------------------------------------------------- mini-batches of one policy update
# One policy update (one ``train_batch`` call, one version) may take several optimizer steps: the trainer
# splits the batch into ``actor.ppo_minibatches`` mini-batches (a per-sequence ``minibatch`` index, so the
# algorithm can normalise its loss per mini-batch) and the engine takes one step per mini-batch for each of
# ``epochs`` passes. These helpers are that split and plan, shared by every engine.

MINIBATCH_KEY = "minibatch"  # per sequence: the mini-batch (optimizer step within a pass) it is trained in
UPDATE_STEP_KEY = "update_step"  # in each micro-batch handed to loss_fn: optimizer steps already taken this update
POLICY_VERSION_KEY = "policy_version"  # the version the batch is trained at (the proximal policy's)


def assign_minibatches(seq_lens: list[int], group_index: list[int] | None, count: int) -> list[int]:
    """Each sequence's mini-batch in ``0..count-1``: groups (``group_index``) kept whole, balanced by tokens.

    Largest group first onto the lightest mini-batch (ties: the lowest index), so the split depends only on
    the lengths and is the same on every rank. Raises when there are fewer groups than mini-batches.
    """
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_index if group_index is not None else range(len(seq_lens))):
        groups.setdefault(int(g), []).append(i)
    if count > len(groups):
        raise ValueError(f"actor.ppo_minibatches is {count} but the batch holds {len(groups)} groups; a group is "
                         f"never split, so use at most {len(groups)} (or a larger rollout.batch_size)")
    tokens = [0] * count
    out = [0] * len(seq_lens)
    for members in sorted(groups.values(), key=lambda m: (-sum(seq_lens[i] for i in m), m[0])):
        target = min(range(count), key=lambda k: (tokens[k], k))
        tokens[target] += sum(seq_lens[i] for i in members)
        for i in members:
            out[i] = target
    return out


def update_plan(batch: dict, epochs: int = 1) -> list[list[int]]:
    """The sequences of each optimizer step of one update, in order: for each of ``epochs`` passes, each
    mini-batch (``batch["minibatch"]``, ascending; the whole batch without it)."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    n = len(as_list(batch["cu_seqlens"])) - 1
    if MINIBATCH_KEY not in batch:
        return [list(range(n))] * epochs
    ids = [int(i) for i in as_list(batch[MINIBATCH_KEY])]
    if len(ids) != n:
        raise ValueError(f"batch['{MINIBATCH_KEY}'] has {len(ids)} entries for {n} sequences")
    steps = [[i for i in range(n) if ids[i] == k] for k in sorted(set(ids))]
    return [seqs for _ in range(epochs) for seqs in steps]


def select_sequences(batch: dict, seqs: list[int]) -> dict:
    """The batch restricted to sequences ``seqs`` (in that order), in the same packed layout.

    Per-token values (length T) and per-sequence values (length N) are sliced; anything else (scalars such
    as ``kl_coef``) is kept. ``cu_seqlens`` / ``seq_lens`` / ``position_ids`` follow the selection.
    """
    cu = [int(c) for c in as_list(batch["cu_seqlens"])]
    T, N = cu[-1], len(cu) - 1
    if T == N:
        raise ValueError("select_sequences: every sequence is one token long, so per-token and per-sequence "
                         "values cannot be told apart")
    tokens = [t for s in seqs for t in range(cu[s], cu[s + 1])]
    out: dict = {}
    for key, value in batch.items():
        if key == "cu_seqlens":
            continue
        n = len(value) if hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict)) else None
        if n == T:
            out[key] = _take(value, tokens)
        elif n == N:
            out[key] = _take(value, seqs)
        else:
            out[key] = value
    lens = [cu[s + 1] - cu[s] for s in seqs]
    out["cu_seqlens"] = [0, *cumsum(lens)]
    return out


def update_batches(batch: dict, epochs: int = 1) -> list[dict]:
    """The batch of each optimizer step of one update, in :func:`update_plan`'s order: each mini-batch selected
    once (:func:`select_sequences`) and taken again by every pass; the batch itself when a step takes all of it."""
    plan = update_plan(batch, epochs)
    whole = list(range(len(as_list(batch["cu_seqlens"])) - 1))
    one_pass = [batch if seqs == whole else select_sequences(batch, seqs) for seqs in plan[:len(plan) // epochs]]
    return one_pass * epochs


def _take(value: Any, index: list[int]) -> Any:
    if hasattr(value, "index_select"):  # a tensor: stay a tensor on its device
        import torch

        return value.index_select(0, torch.tensor(index, dtype=torch.long, device=value.device))
    return [value[i] for i in index]


def merge_update_stats(steps: list[dict[str, float]], epochs: int = 1) -> dict[str, float]:
    """The stats of one update's optimizer steps as one record: the mean of each over the steps, beside
    ``grad_norm_max``, ``update_skipped`` (steps skipped) and ``n_optimizer_steps``; the counts ``n_tokens``,
    ``n_loss_tokens`` and ``n_micro_batches`` are the batch's (one pass). One step: its stats unchanged, plus
    ``n_optimizer_steps`` 1."""
    if len(steps) == 1:
        return {**steps[0], "n_optimizer_steps": 1.0}
    out: dict[str, float] = {}
    for key in {k for s in steps for k in s}:
        values = [s[key] for s in steps if key in s]
        out[key] = sum(values) / len(values)
    for key in ("n_tokens", "n_loss_tokens", "n_micro_batches"):
        if key in out:
            out[key] = sum(s.get(key, 0.0) for s in steps) / epochs
    out["update_skipped"] = float(sum(s.get("update_skipped", 0.0) for s in steps))
    if any("grad_norm" in s for s in steps):
        out["grad_norm_max"] = max(s["grad_norm"] for s in steps if "grad_norm" in s)
    out["n_optimizer_steps"] = float(len(steps))
    return out


class Packed:
    """A trainer batch as CPU tensors (:func:`to_tensor`) with its sequence boundaries, cut into micro-batches
    by sequence. ``who`` names the engine in errors about a malformed batch."""

    def __init__(self, batch: dict, who: str = "the train engine") -> None:
        cu = [int(c) for c in as_list(batch["cu_seqlens"])]
        if len(cu) < 2:
            raise ValueError(f"{who}: the batch holds no sequences (cu_seqlens has fewer than 2 entries)")
        n_ids = len(as_list(batch["input_ids"]))
        if n_ids != cu[-1]:
            raise ValueError(f"{who}: the batch has {n_ids} input_ids but cu_seqlens ends at {cu[-1]}")
        from areal_core.api.batch import PackedBatch

        if isinstance(batch, PackedBatch):  # each list column converted once, kept for the next reader
            self.tensors = {k: batch.tensor(k) for k in list(batch) if k != "cu_seqlens"}
        else:
            self.tensors = {k: to_tensor(k, v) for k, v in batch.items() if k != "cu_seqlens"}
        self.cu = cu
        self.T = cu[-1]
        self.lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.ids = self.tensors["input_ids"]
        self.shortest = min(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))

    def lens(self, seqs: list[int]) -> list[int]:
        return [self.lengths[s] for s in seqs]

    def token_index(self, seqs: list[int]) -> Any:
        import torch

        return torch.cat([torch.arange(self.cu[s], self.cu[s + 1]) for s in seqs])

    def micro_batch(self, seqs: list[int], with_positions: bool = False) -> dict:
        """Per-token keys over the tokens of ``seqs`` (packed in that order), per-sequence keys over ``seqs``,
        anything else as is; plus ``seq_lens``, ``cu_seqlens``, ``token_index`` (the tokens' places in the
        batch) and, with ``with_positions``, ``position_ids`` counting from 0 in each sequence unless the
        batch carries its own."""
        import torch

        tokens = self.token_index(seqs)
        n_seq = len(self.lengths)
        mb: dict = {}
        for key, value in self.tensors.items():
            if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == self.T:
                mb[key] = value[tokens]
            elif isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n_seq:
                mb[key] = value[torch.tensor(seqs, dtype=torch.long)]
            else:
                mb[key] = value
        lens = self.lens(seqs)
        mb["seq_lens"] = torch.tensor(lens, dtype=torch.long)
        mb["cu_seqlens"] = torch.tensor([0, *cumsum(lens)], dtype=torch.long)
        mb["token_index"] = tokens
        if with_positions and "position_ids" not in mb:
            mb["position_ids"] = torch.cat([torch.arange(n) for n in lens])
        return mb
