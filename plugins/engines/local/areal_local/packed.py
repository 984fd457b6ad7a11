"""Linear layers on oneDNN-prepacked weights, for CPU decoding.

Why: on this class of machine (2 cores, no AMX) a decode step is a string of
skinny GEMMs (``[B, hidden] x [hidden, out]`` with B = running requests), and
torch's default fp32 ``linear`` picks erratic kernels for them: the LM head
(49152 x 576 for SmolLM2) took 25-31 ms at B = 15 but 10-13 ms at B = 16, and
every ``B < 16`` read the weight several times over. The same GEMMs through
oneDNN on weights reordered once ahead of time (``mkldnn._reorder_linear_weight``
+ ``mkldnn._linear_pointwise``, what torch's Inductor emits for frozen CPU
linears) cost 7.3 ms at B = 15 and 7.5 ms at B = 16 and are steady under load
(measured with the script in this module's test notes; numbers in
``benchmarks/generation.py``'s docstring). intel-extension-for-pytorch's
``ipex.optimize`` does this for whole models but pins its own torch versions;
this is the ~40 lines of it the generator needs.

Results differ from ``F.linear`` by float rounding only (SmolLM2 logits within
1e-4 after 30 layers). The packed copies are refreshed by :meth:`PackedLinears.refresh`
whenever the module weights change (the generator calls it after every weight load).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(model: nn.Module) -> bool:
    """oneDNN is built in and the model's linears are CPU float32, or bfloat16 on a CPU oneDNN computes it on.

    oneDNN's bf16 linear needs AVX512 (bw, vl, dq) or AVX-NE-CONVERT; on an
    AVX2-only CPU its reorder raises, so bf16 models there keep torch's own
    linear (slower, but it runs).
    """
    if not torch.backends.mkldnn.is_available():
        return False
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if not weights or not all(w.device.type == "cpu" and w.dtype in _SUPPORTED_DTYPES for w in weights):
        return False
    return all(w.dtype != torch.bfloat16 for w in weights) or onednn_bf16_supported()


def onednn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bf16 kernels (torch's own probe of the CPU's instruction sets)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def repack(packed: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's packed layout, bit for bit ``_reorder_linear_weight(weight, None)``: written into
    ``packed`` (the packed copy of an earlier weight of the same shape and dtype) when there is one, else fresh.

    Why not ``packed.copy_(weight.to_mkldnn())`` (what this did before): mkldnn ``copy_`` gives the destination
    the SOURCE's layout (ideep's ``direct_copy`` re-initialises it), so that left plain, unpacked weights
    behind and every ``_linear_pointwise`` on them reordered the whole weight again. After a weight load,
    SmolLM2-135M decoding at batch 16 on one thread of the 2-core test machine took 130.7 ms a step in float32
    and 99.6 ms in bfloat16, against 90.7 and 71.0 ms on packed weights (``benchmarks/repack.py``; the LM head
    alone: 17.6 against 13.0 ms, 13.4 against 6.3 ms). Rebuilding the real packing costs more than the plain
    copies did (float32 0.23 s against 0.12 s, bfloat16 0.10 against 0.055 s); decoding wins that back in
    three to four steps.

    In place, the packed layout is written by one strided torch copy into the packed tensor's own memory
    (:func:`_layout_plan`): no temporary, and faster than oneDNN's own reorder into new memory (the LM head:
    28 against 40 ms in float32; all of SmolLM2's linears, alternated on a loaded machine: 0.21-0.27 against
    0.22-0.32 s in float32, 0.10-0.15 against 0.11-0.19 s in bfloat16). Layouts without a plan (padded blocks:
    shapes that are not whole numbers of oneDNN's blocks) take a fresh reorder, copied into ``packed``'s
    memory when the layouts match.
    """
    if packed is None or packed.shape != weight.shape or packed.dtype != weight.dtype or not weight.numel():
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    weight = weight.contiguous()
    layout = _layout(packed)
    plan = _layout_plan(layout, weight.dtype) if layout is not None else None
    if plan is not None:
        plan.write(_memory_of(packed), weight)
        return packed
    fresh = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    if layout is None or _layout(fresh) != layout:
        return fresh
    _memory_of(packed).copy_(_memory_of(fresh))
    return packed


def _memory_of(packed: torch.Tensor) -> torch.Tensor:
    """The bytes of mkldnn tensor ``packed``, as a dense uint8 tensor on the same memory.

    Only valid while ``packed`` lives and keeps its memory (callers use it at once and drop it).
    """
    size = torch.ops.mkldnn._nbytes(packed)
    buffer = (ctypes.c_char * size).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=torch.uint8)


class _Layout(NamedTuple):
    """The fields of a 2-d oneDNN blocked memory descriptor that place the elements (oneDNN's
    ``dnnl_memory_desc_t``: dims, padded dims, outer strides, inner blocks)."""

    dims: tuple[int, ...]
    padded: tuple[int, ...]
    strides: tuple[int, ...]
    blocks: tuple[int, ...]
    block_dims: tuple[int, ...]


def _layout(packed: torch.Tensor) -> _Layout | None:
    """Read ``packed``'s memory descriptor from its serialized form (``mkldnn._get_mkldnn_serialized_md``:
    oneDNN's ``dnnl_memory_desc_t`` after a 4-byte header); None for anything but a plain 2-d blocked one.

    The byte offsets are oneDNN 3's struct layout; should a torch ship another, what is read here fails the
    checks below or :func:`_layout_plan`'s probe, and :func:`repack` falls back to fresh reorders.
    """
    try:
        blob = torch.ops.mkldnn._get_mkldnn_serialized_md(packed)
    except (AttributeError, RuntimeError):  # a torch without the op, or a tensor it does not describe
        return None
    if blob.dtype != torch.uint8 or blob.numel() < 616 or blob.numel() % 4:
        return None
    words = blob.view(torch.int32).tolist()  # one call: this runs for every weight at every load

    def ints(offset: int, n: int, width: int = 8) -> tuple[int, ...]:
        at = offset // 4
        if width == 4:
            return tuple(words[at:at + n])
        return tuple((words[at + 2 * k] & 0xFFFFFFFF) | (words[at + 2 * k + 1] << 32) for k in range(n))

    (ndims,) = ints(4, 1, 4)
    (format_kind,) = ints(312, 1, 4)
    (n_blocks,) = ints(416, 1, 4)
    if ndims != 2 or format_kind != _BLOCKED or not 0 <= n_blocks <= 12 or ints(8, 2) != tuple(packed.shape):
        return None
    if any(ints(208, 2)) or ints(304, 1) != (0,):  # padded offsets, offset0
        return None
    layout = _Layout(ints(8, 2), ints(112, 2), ints(320, 2), ints(424, n_blocks), ints(520, n_blocks))
    if any(d not in (0, 1) for d in layout.block_dims) or any(b < 1 for b in layout.blocks):
        return None
    return layout


_BLOCKED = 2  # dnnl_format_kind_t: dnnl_blocked


class _Plan(NamedTuple):
    """How to write a [out, in] weight into a packed layout with one strided copy: the weight viewed as
    ``split`` (each dim cut into its outer part and its inner blocks), permuted by ``order``, is the packed
    memory viewed as ``packed_shape``; ``wide``: copy pairs of 2-byte elements as one 4-byte word."""

    split: tuple[int, ...]
    order: tuple[int, ...]
    packed_shape: tuple[int, ...]
    wide: bool

    def write(self, memory: torch.Tensor, weight: torch.Tensor) -> None:
        """Copy ``weight`` (contiguous, the layout's shape and dtype) into packed ``memory``."""
        source = weight.view(self.split).permute(self.order)
        target = memory.view(weight.dtype).view(self.packed_shape)
        if self.wide:
            source, target = source.view(torch.int32)[..., 0], target.view(torch.int32)[..., 0]
        target.copy_(source)


@functools.cache
def _layout_plan(layout: _Layout, dtype: torch.dtype) -> _Plan | None:
    """The :class:`_Plan` that writes ``layout`` (unpadded blocked layouts), checked against oneDNN's own
    reorder of probe weights whose elements say where they come from; None if there is none or it fails."""
    if layout.padded != layout.dims:
        return None
    per_dim = [[b for b, d in zip(layout.blocks, layout.block_dims) if d == dim] for dim in (0, 1)]
    totals = [math.prod(blocks) for blocks in per_dim]
    if any(size % total for size, total in zip(layout.dims, totals)):
        return None
    # Axes of the split view: dim 0's outer part and blocks, then dim 1's.
    split, axis_of_block, outer_axis = [], {}, []
    for dim, blocks in enumerate(per_dim):
        outer_axis.append(len(split))
        split.append(layout.dims[dim] // totals[dim])
        for k in range(len(blocks)):
            axis_of_block[(dim, k)] = len(split)
            split.append(blocks[k])
    # Physical order: the outer parts by falling stride, then the inner blocks as listed (the last innermost).
    outer = sorted((0, 1), key=lambda dim: -layout.strides[dim])
    seen = [0, 0]
    inner = []
    for dim in layout.block_dims:
        inner.append(axis_of_block[(dim, seen[dim])])
        seen[dim] += 1
    order = tuple([outer_axis[dim] for dim in outer] + inner)
    packed_shape = tuple(split[axis] for axis in order)
    wide = dtype.itemsize == 2 and packed_shape[-1] == 2 and order[-1] == len(split) - 1
    plan = _Plan(tuple(split), order, packed_shape, wide)
    return plan if _plan_holds(plan, layout, dtype) else None


def _plan_holds(plan: _Plan, layout: _Layout, dtype: torch.dtype) -> bool:
    """Whether ``plan`` puts every element where oneDNN's reorder does: probes holding each element's row,
    then its column, one base-256 digit at a time (small integers: exact in every supported dtype)."""
    rows, cols = layout.dims
    for dim, size in enumerate((rows, cols)):
        base = 1
        while base < size:
            digits = ((torch.arange(size) // base) % 256).to(dtype)
            probe = (digits[:, None] if dim == 0 else digits[None, :]).expand(rows, cols).contiguous()
            packed = torch.ops.mkldnn._reorder_linear_weight(probe, None)
            if _layout(packed) != layout:
                return False
            written = torch.empty(torch.ops.mkldnn._nbytes(packed), dtype=torch.uint8)
            plan.write(written, probe)
            words = torch.int64 if written.numel() % 8 == 0 else torch.uint8  # torch.equal: 8 bytes at a time
            if not torch.equal(written.view(words), _memory_of(packed).view(words)):
                return False
            base *= 256
    return True


class PackedLinears:
    """Route every ``nn.Linear`` of ``model`` through a prepacked copy of its weight.

    The modules keep their own ``weight`` (state dicts, weight loading and
    training code see no difference); each gets an instance-level
    ``forward`` that uses the packed copy. :meth:`detach` restores the plain
    forward; :meth:`refresh` repacks after the weights changed.
    """

    def __init__(self, model: nn.Module) -> None:
        if not packing_available(model):
            raise ValueError("PackedLinears: needs torch built with oneDNN and CPU float32 linear layers, or bfloat16 "
                             "ones on a CPU with oneDNN bf16 kernels (AVX512 bw/vl/dq or AVX-NE-CONVERT)")
        self.modules = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self._packed: dict[int, torch.Tensor] = {}
        self.live = True  # False: forwards use the modules' own weights (the packed copies being rebuilt)
        self.refresh()
        for module in self.modules:
            module.forward = self._forward_of(module)  # instance attribute: nn.Module.__call__ finds it first

    def _forward_of(self, module: nn.Linear):
        key, packed = id(module), self._packed

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self.live:
                return nn.functional.linear(x, module.weight, module.bias)
            return torch.ops.mkldnn._linear_pointwise(x, packed[key], module.bias, "none", [], "")

        return forward

    def weight_of(self, module: nn.Linear) -> torch.Tensor:
        """The packed copy of ``module``'s weight (for callers that fuse post-ops onto the matmul)."""
        return self._packed[id(module)]

    @torch.no_grad()
    def refresh(self) -> None:
        """Repack every weight (after a weight load), into the packed copies already there (:func:`repack`)."""
        for _, job in self.jobs():
            job()

    def jobs(self) -> list[tuple[int, Callable[[], None]]]:
        """:meth:`refresh` as one job per weight, (elements, call), for callers that spread them over threads;
        the jobs touch disjoint packed copies."""
        def job(module: nn.Linear) -> Callable[[], None]:
            def run() -> None:
                with torch.no_grad():
                    self._packed[id(module)] = repack(self._packed.get(id(module)), module.weight.detach())
            return run

        return [(module.weight.numel(), job(module)) for module in self.modules]

    def detach(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self._packed.clear()
