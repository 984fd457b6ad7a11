"""Delta weight updates (``rollout.weight_delta: auto``): between consecutive versions send only the elements
whose bits changed.

Between two optimizer steps most bf16 parameters keep their bits (an update smaller than half a unit in the last
place rounds away), so a tensor's changed elements, as flat indices plus their new values, are often far smaller
than the tensor. :func:`make_delta` compares each tensor with the one sent for the previous version, bit for bit
(an integer view, so -0.0 / 0.0 and NaN payloads count as changes), and sends it sparse only when that is smaller
than whole; a tensor that changed in too many places goes whole. Applying the delta (:func:`apply_delta`) to the
weights of exactly ``base_version`` gives the new version's weights bit for bit; an engine holding any other version
refuses it (:class:`DeltaBaseMismatch`) and gets a full update instead. The integrity gate
(:mod:`areal_core.weight_check`) digests the full new weights on the trainer's side, so it covers deltas.

Deciding costs a pass over both versions. A tensor whose elements nearly all change (float32 weights under Adam: the
demo on a CPU without bf16) is recognised from a strided sample first and sent whole without the full compare, and
a delta that would carry more than :data:`MAX_DELTA_SHARE` of the model is not sent at all (the trainer sends the
full weights through their own, faster path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

WEIGHT_DELTA_MODES = ("auto", "off")
SAMPLE_ELEMENTS = 4096  # the strided sample that decides a tensor is not worth comparing in full
# A delta carrying more than this share of the model is not sent: the full weights' path is faster (the embedded
# engine rewrites its /dev/shm file in place for full weights, a delta's file is new each time)
MAX_DELTA_SHARE = 0.5


class DeltaBaseMismatch(RuntimeError):
    """An engine was handed a delta whose base is not the version it holds; it must get a full update."""


@dataclass
class WeightDelta:
    """The change from ``base_version`` to ``version``: tensors sent whole, and (name, flat indices, values)."""

    base_version: int
    version: int
    full: list[tuple[str, Any]] = field(default_factory=list)
    sparse: list[tuple[str, Any, Any]] = field(default_factory=list)
    full_nbytes: int = 0  # what the whole model weighs (what a full update sends)

    @property
    def nbytes(self) -> int:
        """The bytes this delta carries."""
        return (sum(t.numel() * t.element_size() for _, t in self.full)
                + sum(i.numel() * i.element_size() + v.numel() * v.element_size() for _, i, v in self.sparse))


def _bits(tensor: Any) -> Any:
    """A flat integer view of ``tensor``'s bits (element for element)."""
    import torch

    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().reshape(-1).view(kind)


def make_delta(base: Mapping[str, Any], named: Iterable[tuple[str, Any]], base_version: int,
               version: int) -> WeightDelta:
    """The delta from ``base`` (name -> the tensor sent for ``base_version``) to ``named`` (the new version)."""
    import torch

    delta = WeightDelta(base_version, version)
    for name, new in named:
        size = new.numel() * new.element_size()
        delta.full_nbytes += size
        old = base.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype or new.numel() == 0:
            delta.full.append((name, new))
            continue
        a, b = _bits(new), _bits(old)
        index_bytes = 4 if a.numel() < 2**31 else 8
        worth = size // (index_bytes + new.element_size())  # changed elements past which whole is smaller
        step = max(1, a.numel() // SAMPLE_ELEMENTS)
        sampled = a[::step] != b[::step]
        # clearly past it (the sample's estimate errs by ~1 % of the elements): no full compare
        if int(sampled.sum()) * step > 1.1 * worth:
            delta.full.append((name, new))
            continue
        changed = a != b
        count = int(changed.sum())
        if count >= worth:
            delta.full.append((name, new))
        elif count:
            index = changed.nonzero().reshape(-1)
            delta.sparse.append((name, index.to(torch.int32 if index_bytes == 4 else torch.int64),
                                 new.reshape(-1)[index].clone()))
    return delta


def apply_delta(held: Mapping[str, Any], delta: WeightDelta) -> None:
    """Apply ``delta`` in place to ``held`` (name -> tensor, the weights of ``delta.base_version``). Everything
    is checked before anything changes; a delta that does not fit is refused with every problem named."""
    import torch

    problems = []
    for name, tensor in delta.full:
        target = held.get(name)
        if target is None or target.shape != tensor.shape:
            problems.append(f"{name!r}: sent whole {tuple(tensor.shape)}, held "
                            f"{None if target is None else tuple(target.shape)}")
    for name, index, values in delta.sparse:
        target = held.get(name)
        if target is None or target.dtype != values.dtype:
            problems.append(f"{name!r}: sent {values.dtype} elements, held "
                            f"{None if target is None else target.dtype}")
        elif index.numel() and int(index.max()) >= target.numel():
            problems.append(f"{name!r}: index {int(index.max())} past its {target.numel()} elements")
    if problems:
        raise ValueError(f"delta {delta.base_version} -> {delta.version} refused, nothing applied: "
                         + "; ".join(problems[:8]))
    with torch.no_grad():
        for name, tensor in delta.full:
            held[name].copy_(tensor)
        for name, index, values in delta.sparse:
            target = held[name]
            flat = target.view(-1) if target.is_contiguous() else None
            if flat is None:
                raise ValueError(f"delta: {name!r} is held non-contiguous; apply a full update")
            flat.index_copy_(0, index.long(), values)


# The delta as named tensors (for transports that carry (name, tensor) pairs: a safetensors file)
INDEX_PREFIX, VALUES_PREFIX = "areal.delta.index:", "areal.delta.values:"


def delta_to_named(delta: WeightDelta) -> list[tuple[str, Any]]:
    out = list(delta.full)
    for name, index, values in delta.sparse:
        out += [(INDEX_PREFIX + name, index), (VALUES_PREFIX + name, values)]
    return out


def delta_from_named(named: Mapping[str, Any], base_version: int, version: int) -> WeightDelta:
    delta = WeightDelta(base_version, version)
    for name, tensor in named.items():
        if name.startswith(INDEX_PREFIX):
            real = name[len(INDEX_PREFIX):]
            delta.sparse.append((real, tensor, named[VALUES_PREFIX + real]))
        elif not name.startswith(VALUES_PREFIX):
            delta.full.append((name, tensor))
    return delta
