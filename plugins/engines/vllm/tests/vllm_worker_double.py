"""Test double of areal's vLLM worker extension: the real one plus methods that corrupt loaded weights, as a
loader layout bug would. Run by the test servers (this folder on their PYTHONPATH, beside the plugin's
server_path): ``--worker-extension-cls vllm_worker_double.TamperingWorkerExtensionDouble``."""

from __future__ import annotations

import weakref

import areal_vllm_worker as ext
from areal_vllm_worker import ArealWorkerExtension

# layer -> what to do to its weight each time it is loaded (before the load hook digests it)
SWAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_record_loaded = ext.record_loaded


def _tampering_record_loaded(layer) -> None:
    parts = SWAPS.get(layer)
    if parts is not None:  # swap two fused parts' rows in place: the layer now computes with them swapped
        sizes = list(layer.output_partition_sizes)
        a, b = parts
        w = layer.weight.data
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        first = w[starts[a]:starts[a] + sizes[a]].clone()
        w[starts[a]:starts[a] + sizes[a]] = w[starts[b]:starts[b] + sizes[b]]
        w[starts[b]:starts[b] + sizes[b]] = first
    _record_loaded(layer)


ext.record_loaded = _tampering_record_loaded


class TamperingWorkerExtensionDouble(ArealWorkerExtension):
    def areal_test_swap_on_load(self, module: str, a: int = -1, b: int = -1) -> int:
        """From the next load on, swap fused parts ``a`` and ``b`` of linear layer ``module`` (e.g. k and v of a
        ``qkv_proj``: 1 and 2) as it is loaded; a negative ``a`` stops it. The number of layers so set."""
        layer = self.model_runner.get_model().get_submodule(module)
        if int(a) < 0:
            SWAPS.pop(layer, None)
        else:
            SWAPS[layer] = (int(a), int(b))
        return len(SWAPS)

    def areal_test_scale(self, parameter: str, factor: float) -> str:
        """Multiply one live parameter (vLLM's name) by ``factor`` in place, now; its new dtype and shape."""
        param = self.model_runner.get_model().get_parameter(parameter)
        param.data.mul_(float(factor))
        return f"{param.dtype}{list(param.shape)}"
