"""Where a megatron engine's rank sits: parallel sizes, Megatron's parallel state, device context.

:class:`ParallelMixin` owns the tensor x pipeline (x virtual pipeline) sizes
read from the allocation and checked against the model, the
``torch.distributed`` world (a one-process gloo group made when there is none,
since Megatron's parallel state needs one), Megatron's ``parallel_state``
groups and RNG seeding, the context Megatron's CUDA calls run in on CPU
(:mod:`areal_megatron.cpu`), whether Transformer Engine is used, and the
small collectives the engine needs (from :mod:`areal_core.engine_kit.collectives`).
"""

from __future__ import annotations

import datetime
import os
from contextlib import nullcontext
from typing import Any

import torch.distributed as dist

from areal_core.engine_kit.collectives import RankCollectives


class ParallelMixin(RankCollectives):
    """Parallel layout of :class:`~areal_megatron.engine.MegatronEngine` (its ``context``, ``options``,
    ``hf_config`` and ``cpu``); sets ``world``, ``rank`` and the tensor / pipeline / data ranks and groups."""

    def _parallel_sizes(self) -> tuple[int, int]:
        """(t, p) of the allocation; context and expert parallel are refused (see ``hooks.UNBUILT``)."""
        from areal_megatron.hooks import UNBUILT

        parallel = getattr(self.context.placement, "parallel", None)
        unbuilt = {dim: getattr(parallel, dim, 1) for dim in UNBUILT}
        unbuilt = {dim: n for dim, n in unbuilt.items() if n > 1}
        if unbuilt:
            why = "; ".join(UNBUILT[dim] for dim in unbuilt)
            dims = ", ".join(f"{dim}{n}" for dim, n in unbuilt.items())
            raise NotImplementedError(
                f"MegatronEngine: the allocation '{self.context.placement}' asks for {dims}, which "
                f"areal-plugin-megatron does not build: {why}. Place the actor with d, t and p only")
        return int(getattr(parallel, "t", 1) or 1), int(getattr(parallel, "p", 1) or 1)

    def _virtual_pipeline_size(self) -> int:
        """``actor.virtual_pipeline_size``, checked against p and the model's layers (as the plan rules do)."""
        vpp, layers = int(self.options.virtual_pipeline_size), int(self.hf_config.num_hidden_layers)
        if vpp > 1 and self.pp == 1:
            raise ValueError(f"MegatronEngine: actor.virtual_pipeline_size={vpp} interleaves pipeline stages, but "
                             f"the allocation '{self.context.placement}' has no pipeline parallel (p1); add p "
                             f"(e.g. 'megatron:p2') or set actor.virtual_pipeline_size=1")
        if layers % self.pp:
            raise ValueError(f"MegatronEngine: pipeline parallel p{self.pp} ('{self.context.placement}') does not "
                             f"divide the model's {layers} layers; choose p among the divisors of {layers}")
        if layers % (self.pp * vpp):
            raise ValueError(f"MegatronEngine: p{self.pp} x actor.virtual_pipeline_size={vpp} = {self.pp * vpp} "
                             f"chunks do not divide the model's {layers} layers; set actor.virtual_pipeline_size "
                             f"to a divisor of {layers // self.pp}")
        return vpp

    def _init_parallel_state(self, cfg: Any) -> None:
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            from areal_core.processes.supervisor import free_port

            # Megatron's parallel state needs a process group even for one process.
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("gloo" if self.cpu else "nccl", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=300))
        world = dist.get_world_size()
        if world % (self.tp * self.pp):
            raise ValueError(f"MegatronEngine: tensor x pipeline parallel t{self.tp} x p{self.pp} does not divide "
                             f"the world of {world} ranks; choose t x p among the divisors of {world}")
        wanted = (self.tp, self.pp, self.vpp)
        if ps.model_parallel_is_initialized():
            have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                    ps.get_virtual_pipeline_model_parallel_world_size() or 1)
            if have != wanted:
                raise RuntimeError(f"MegatronEngine: Megatron's parallel state is already set up with (t, p, "
                                   f"virtual pipeline) = {have}, not {wanted}; engines of one process must share it")
        else:
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                                         virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None)
        self.world = world
        self.rank = dist.get_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        seed = int(cfg.trainer.seed)
        if self.cpu:
            from areal_megatron.cpu import install_cpu_rng_tracker

            install_cpu_rng_tracker(seed, self.tp_rank)
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed, force_reset_rng=True)

    def _cuda_context(self) -> Any:
        """On CPU, Megatron's CUDA names read as the CPU (:mod:`areal_megatron.cpu`); on GPU nothing."""
        if not self.cpu:
            return nullcontext()
        from areal_megatron.cpu import cuda_device_reads_cpu  # imports megatron: only once an engine runs

        return cuda_device_reads_cpu()

    def _use_te(self) -> bool:
        if self.cpu or not self.options.transformer_engine:
            return False
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return False
        return True
