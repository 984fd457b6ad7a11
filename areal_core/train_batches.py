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
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, bool)) for v in value):
        t = torch.tensor(value)
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
