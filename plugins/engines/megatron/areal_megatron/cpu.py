"""The CPU accommodation: the only place where this plugin works around Megatron-Core's CUDA assumptions.

megatron-core 0.16.1 builds a ``GPTModel`` on CPU (``use_cpu_initialization``)
and its local (non Transformer Engine) modules compute on CPU tensors, but
three points assume CUDA (../shared/FEASIBILITY.md):

1. The forward asks ``torch.cuda.current_device()`` for the device of new
   tensors: the rotary embedding moves ``inv_freq`` there on its first call,
   and the attention's scratch buffer (``get_global_memory_buffer``) is
   allocated there. :func:`cuda_device_reads_cpu` makes that one function
   return ``"cpu"`` for the duration of a forward (and backward) on CPU.
2. The RNG tracker (``get_cuda_rng_tracker``), which attention forks around
   its dropout, stores CUDA generator states. :func:`install_cpu_rng_tracker`
   installs :class:`CPURNGStatesTracker`, the same tracker over CPU generator
   states, seeded as ``model_parallel_cuda_manual_seed`` seeds it.
3. ``get_megatron_optimizer`` hard-codes ``device='cuda'``: on CPU the engine
   uses ``torch.optim.AdamW`` and reduces gradients itself
   (:mod:`areal_megatron.engine`); on GPU it uses Megatron's own
   ``DistributedDataParallel`` and ``DistributedOptimizer``.

4. With ``use_cpu_initialization`` and no random init, the parallel layers
   never mark their weights as tensor-parallel shards (the marking happens
   inside the CPU init routine). :func:`mark_tensor_parallel_shards` marks
   them as the GPU path does, so that gradient norms count each shard once.

The fused CUDA kernels (softmax, bias-activation, rope) are switched off by the
config on CPU (:func:`areal_megatron.convert.transformer_config`). Nothing here
is applied on GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import torch

# The tracker names and seed offsets of megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed.
_SEED_OFFSETS = {"data-parallel-rng": 0, "model-parallel-rng": 2718, "expert-parallel-rng": 1024 + 100}


@contextlib.contextmanager
def cuda_device_reads_cpu() -> Iterator[None]:
    """While inside, ``torch.cuda.current_device()`` returns ``"cpu"`` (point 1 above; CPU runs only)."""
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


def _tracker_base() -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class CPURNGStatesTracker(_tracker_base()):
    """Megatron's RNG states tracker over CPU generator states (point 2 above)."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"CPURNGStatesTracker: seed {seed} or state {name!r} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"CPURNGStatesTracker: no RNG state {name!r} (install_cpu_rng_tracker adds them)")
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()


def install_cpu_rng_tracker(seed: int, tp_rank: int = 0) -> CPURNGStatesTracker:
    """Replace Megatron's global RNG tracker with a seeded :class:`CPURNGStatesTracker` (point 2 above)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CPURNGStatesTracker()
    for name, offset in _SEED_OFFSETS.items():
        tracker.add(name, seed + offset + (tp_rank if name == "model-parallel-rng" else 0))
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def mark_tensor_parallel_shards(model: Any) -> int:
    """Set Megatron's ``tensor_model_parallel`` / ``partition_dim`` on the sharded parameters of ``model``
    where the CPU build left them unset (point 4 above); returns how many were marked."""
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               set_tensor_model_parallel_attributes)

    marked = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            shards = [(getattr(module, "weight", None), 0), (getattr(module, "bias", None), 0)]
        elif isinstance(module, RowParallelLinear):
            shards = [(getattr(module, "weight", None), 1)]  # the bias of a row-parallel layer is replicated
        else:
            continue
        for param, dim in shards:
            if isinstance(param, torch.nn.Parameter) and not getattr(param, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(param, True, dim, 1)
                marked += 1
    return marked
