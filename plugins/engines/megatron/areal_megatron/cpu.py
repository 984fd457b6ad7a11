"""The CPU accommodation: the only place where this plugin works around Megatron-Core's CUDA assumptions.

megatron-core 0.16.1 builds a ``GPTModel`` on CPU (``use_cpu_initialization``)
and its local (non Transformer Engine) modules compute on CPU tensors, but
a few points assume CUDA (../shared/FEASIBILITY.md):

1. Its code asks for CUDA by name. The forward asks
   ``torch.cuda.current_device()`` for the device of new tensors (the rotary
   embedding moves ``inv_freq`` there on its first call, the attention's
   scratch buffer and the pipeline's receive buffers are allocated there);
   the pipeline schedules count tokens in ``torch.zeros(..., device="cuda")``;
   a tied embedding's copy on the last pipeline stage is moved with
   ``.cuda()`` before its first all-reduce; and the variable-length shape
   exchange between stages ends in ``torch.cuda.synchronize()``.
   :func:`cuda_device_reads_cpu` makes all of these mean the CPU while a
   forward, a schedule or a model build runs on CPU.
2. The RNG tracker (``get_cuda_rng_tracker``), which attention forks around
   its dropout, stores CUDA generator states. :func:`install_cpu_rng_tracker`
   installs :class:`CPURNGStatesTracker`, the same tracker over CPU generator
   states, seeded as ``model_parallel_cuda_manual_seed`` seeds it.
3. ``get_megatron_optimizer`` hard-codes ``device='cuda'``: on CPU the engine
   uses ``torch.optim.AdamW`` and reduces gradients itself (over data-parallel
   ranks, and a tied embedding's gradient between the first and last pipeline
   stage; :mod:`areal_megatron.engine`); on GPU it uses Megatron's own
   ``DistributedDataParallel``, ``finalize_model_grads`` and
   ``DistributedOptimizer``.

The fused CUDA kernels (softmax, bias-activation, rope) are switched off by the
config on CPU (:func:`areal_megatron.convert.transformer_config`). Nothing here
is applied on GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

# The tracker names and seed offsets of megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed.
_SEED_OFFSETS = {"data-parallel-rng": 0, "model-parallel-rng": 2718, "expert-parallel-rng": 1024 + 100}


class _CudaNamesCPU(TorchFunctionMode):
    """Tensors asked for on ``device="cuda"`` are made on the CPU, and ``Tensor.cuda()`` keeps a tensor where it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        # A bare int is a CUDA ordinal (torch.device(0) itself fails where no accelerator exists).
        if isinstance(device, int) or (isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_device_reads_cpu() -> Iterator[None]:
    """While inside, CUDA as Megatron names it means the CPU (point 1 above; CPU runs only):
    ``torch.cuda.current_device()`` returns ``"cpu"``, ``device="cuda"`` in a factory call gives a CPU tensor,
    ``Tensor.cuda()`` returns the tensor itself and ``torch.cuda.synchronize()`` does nothing (CPU work is
    synchronous)."""
    current, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    try:
        with _CudaNamesCPU():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = current, synchronize


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

