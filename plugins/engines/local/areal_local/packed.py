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
    """``weight`` in oneDNN's packed layout: written into ``packed`` (the packed copy of an earlier weight of
    the same shape and dtype) when there is one, else a fresh ``_reorder_linear_weight``.

    ``copy_`` between mkldnn tensors reorders into the destination's layout, the one oneDNN chose for this
    shape, so the result is bit for bit the fresh reorder's and so are the matmuls on it (checked in the
    tests), and it is faster: every linear of SmolLM2-135M in float32 on one thread of the 2-core test
    machine took 0.14 s against 0.33 s for fresh reorders (no new memory to fault in, no layout query).
    """
    if packed is not None and packed.shape == weight.shape and packed.dtype == weight.dtype:
        try:
            packed.copy_(weight.to_mkldnn())
            return packed
        except RuntimeError:  # a dtype this torch's mkldnn copy does not take: the fresh reorder below
            pass
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


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
        self.refresh()
        for module in self.modules:
            module.forward = self._forward_of(module)  # instance attribute: nn.Module.__call__ finds it first

    def _forward_of(self, module: nn.Linear):
        key, packed = id(module), self._packed

        def forward(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed[key], module.bias, "none", [], "")

        return forward

    def weight_of(self, module: nn.Linear) -> torch.Tensor:
        """The packed copy of ``module``'s weight (for callers that fuse post-ops onto the matmul)."""
        return self._packed[id(module)]

    @torch.no_grad()
    def refresh(self) -> None:
        """Repack every weight (after a weight load), into the packed copies already there (:func:`repack`)."""
        for module in self.modules:
            self._packed[id(module)] = repack(self._packed.get(id(module)), module.weight.detach())

    def detach(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self._packed.clear()
