"""How the fsdp engine spreads one model over its ranks: the device mesh, tensor parallel, FSDP2 sharding.

With ``torch.distributed`` initialized (gloo on CPU, nccl on GPU) the world
is a ``(dp, cp, tp)`` device mesh, ``tp`` the inner dimension (rank =
(dp_rank * cp + cp_rank) * tp + tp_rank; ``tp`` and ``cp`` are the
allocation's ``t`` and ``c``, 1 by default, in any combination). Tensor
parallel first splits each decoder layer's heads and MLP columns over the
``tp`` ranks (DTensor); then, when ``dp x cp > 1``, every decoder layer and
the root are ``fully_shard``-ed over the ``dp`` (and ``cp``) ranks (the
FSDP2 + TP recipe). Context parallel gives each cp rank a share of every
packed row (:mod:`areal_fsdp.context`). With both, each rank holds its
share of the row for its share of the heads: the column-parallel q/k/v
projections hand attention plain tensors of the local heads, whose keys and
values are all-gathered over the cp group (the ranks with the same dp and
tp rank), so the row is reassembled head by head. Without a process group
the world is this process.

:class:`ParallelMixin` holds these parts of :class:`areal_fsdp.engine.FSDPEngine`,
with the gradient norm over tensor-parallel shards and the collectives' helpers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal_core.engine_kit.collectives import RankCollectives

from areal_fsdp.model import _LogprobModel


class ParallelMixin(RankCollectives):
    """The mesh, tensor parallel and sharding of :class:`~areal_fsdp.engine.FSDPEngine` (its ``world``, ``dp``,
    ``cp``, ``tp``, ``device``, ``dtype`` and ``options``)."""

    def _model_parallel_sizes(self) -> tuple[int, int]:
        """The allocation's (t, c), checked against the ranks started and the options."""
        parallel = getattr(self.context.placement, "parallel", None)
        d, t, c = (int(getattr(parallel, dim, 1) or 1) for dim in ("d", "t", "c"))
        layout = f"d{d}" + (f"t{t}" if t > 1 else "") + (f"c{c}" if c > 1 else "")
        if c > 1 and self.options.attn_implementation != "sdpa":
            raise ValueError(f"FSDPEngine: actor.attn_implementation={self.options.attn_implementation!r} cannot "
                             f"run context parallel (c{c}), which attends through its own all-gather sdpa; set "
                             f"actor.attn_implementation=sdpa or use d{d * c}")
        if t * c > 1 and d * t * c != self.world:
            raise RuntimeError(f"FSDPEngine: the allocation asks for {layout} but {self.world} rank(s) were "
                               f"started; it needs exactly d x t x c = {d * t * c} ranks")
        if t > 1 and self.options.lora_rank > 0:
            raise NotImplementedError(f"FSDPEngine: LoRA (actor.lora_rank={self.options.lora_rank}) with tensor "
                                      f"parallel (t{t}) is not built; use d{d * t} or actor.lora_rank=0")
        return t, c

    def _device_mesh(self) -> Any:
        """The ranks as a ``("dp", "cp", "tp")`` grid, ``tp`` inner (a dimension of size 1 is left out)."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = {name: n for name, n in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp)) if n > 1}
        return init_device_mesh(self.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))

    def _dp_group(self) -> Any:
        """The process group of this rank's data-parallel peers (the same context and tensor-parallel rank);
        None = the world."""
        return self.mesh["dp"].get_group() if self.dp < self.world else None


    def _tensor_parallel(self, model: _LogprobModel) -> None:
        """Megatron-style tensor parallel through DTensor: attention heads and MLP columns split over the tp ranks.

        q/k/v and gate/up are column-parallel, o and down row-parallel (their
        outputs all-reduced), so each rank runs its share of the heads;
        embeddings, norms and the output head stay whole on every tp rank
        (FSDP shards them over the dp ranks when there are several).
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        config = model.lm.config
        heads = getattr(config, "num_attention_heads", 0)
        kv_heads = getattr(config, "num_key_value_heads", heads) or heads
        if heads % self.tp or kv_heads % self.tp:
            raise ValueError(f"FSDPEngine: t{self.tp} must divide the model's {heads} attention and {kv_heads} "
                             f"key-value heads; choose a t that divides both, or use d")
        model.to(self.device)
        plan = {**{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
                "self_attn.o_proj": RowwiseParallel(),
                **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
                "mlp.down_proj": RowwiseParallel()}
        for layer in self._decoder_layers(model):
            names = {name for name, _ in layer.named_modules()}
            missing = [name for name in plan if name not in names]
            if missing:
                raise NotImplementedError(f"FSDPEngine: tensor parallel knows Llama-style layers (self_attn.q_proj "
                                          f"... mlp.down_proj); {type(layer).__name__} has no {missing}. Use d")
            parallelize_module(layer, self.mesh["tp"], plan)

    def _shard(self, model: _LogprobModel) -> None:
        """FSDP2 over the dp x cp ranks: each decoder layer, then the root (after tensor parallel, if any).

        The cp ranks of a group hold the same weights, so they shard them like
        data-parallel peers (as torchtitan does): each keeps 1 / (dp x cp) of
        every weight, and gradients are reduced over dp and cp together.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.dp > 1 and self.cp > 1:
            mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        else:
            mesh = self.mesh["dp" if self.dp > 1 else "cp"]
        params_dtype = next(model.parameters()).dtype
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) \
            if params_dtype != self.dtype else MixedPrecisionPolicy()
        for layer in self._decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=self.options.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=self.options.reshard_after_forward)

    @staticmethod
    def _decoder_layers(model: _LogprobModel) -> list[nn.Module]:
        layer_classes = set(getattr(model.lm, "_no_split_modules", None) or [])
        layers = [m for m in model.lm.modules() if type(m).__name__ in layer_classes]
        if not layers:
            raise RuntimeError(f"FSDPEngine: {type(model.lm).__name__} names no decoder layer class "
                               f"(_no_split_modules); cannot shard it layer by layer")
        return layers

    def _clip_tensor_parallel(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Global grad norm over parameters split on any dims of the mesh (or whole), clipped as ``clip_grad_norm_``.

        Each local piece is held by ``world / (sizes of the mesh dims it is
        split over)`` ranks (a whole tensor by all of them), so every rank adds
        its squares divided by that count and one all-reduce over the world
        counts each element once: tp-split q_proj, dp-sharded norms and
        (tp x dp)-split layers alike.
        """
        from torch.distributed.tensor import DTensor

        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            g, holders = p.grad, self.world
            if isinstance(g, DTensor):
                for size, placement in zip(g.device_mesh.shape, g.placements):
                    holders //= 1 if placement.is_replicate() else size  # Shard or _StridedShard
                g = g.to_local()
            total += g.float().pow(2).sum() / holders
        box = total.to(self._comm_device())
        dist.all_reduce(box)
        norm = float(box.sqrt())
        if math.isfinite(norm):
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        return norm
