"""A megatron engine's forward and backward passes and its optimizer.

:class:`StepsMixin` owns:

- the micro-batch plan of a batch (:func:`areal_core.engine_kit.packing.rank_micro_batches`: the
  data-parallel ranks share the sequences with balanced token counts and run the same number of
  micro-batches, a multiple of p with virtual stages);
- a micro-batch as one packed row with its attention mask or THD boundaries (:meth:`StepsMixin._row`);
- Megatron's pipeline schedule over the micro-batches (:meth:`StepsMixin._schedule`), the logprobs and
  ``loss_fn`` on the last stage;
- the optimizer: built (torch's AdamW on CPU, Megatron's DDP and distributed optimizer on GPU), the
  learning rate (:class:`areal_core.engine_kit.optim.Schedule`), and one step of an update
  (:meth:`StepsMixin._optimizer_step`: reduce, clip, apply).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Iterator

import torch
import torch.distributed as dist

from areal_core.engine_kit.optim import Schedule, adamw_kwargs, parameter_groups
from areal_core.engine_kit.packing import rank_micro_batches
from areal_core.train_batches import UPDATE_STEP_KEY, Packed, combine_stats, cumsum, scalar_stats
from areal_megatron.logprobs import vocab_parallel_logprobs


class StepsMixin:
    """Micro-batches, schedule and optimizer of :class:`~areal_megatron.engine.MegatronEngine` (its chunks,
    parallel ranks and groups, ``device``, ``dtype`` and ``options``)."""

    # ------------------------------------------------------------------ optimizer
    def _wrap_gpu(self, cfg: Any) -> None:
        """GPU: Megatron's DistributedDataParallel per chunk and distributed optimizer (clipping inside, over
        every stage)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = cfg.actor.optimizer
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                   overlap_grad_reduce=False)
        # Only the first chunk's buckets overlap with compute in Megatron's setup; nothing overlaps here.
        self.model = [DistributedDataParallel(self.tf_config, ddp_config, chunk,
                                              disable_bucketing=v > 0).eval()
                      for v, chunk in enumerate(self.chunks)]
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.beta1, adam_beta2=o.beta2,
            adam_eps=o.eps, clip_grad=float(o.grad_clip) if o.grad_clip > 0 else 0.0,
            use_distributed_optimizer=True, bf16=False, params_dtype=torch.float32), self.model)
        self._build_scheduler(cfg, self.optimizer.param_groups)

    def _build_cpu_optimizer(self, cfg: Any) -> None:
        o = cfg.actor.optimizer
        self.optimizer = torch.optim.AdamW(parameter_groups(self._parameters(), o.weight_decay), **adamw_kwargs(o))
        self.grad_clip = float(o.grad_clip)
        self._build_scheduler(cfg, self.optimizer.param_groups)

    def _build_scheduler(self, cfg: Any, groups: list[dict]) -> None:
        self.schedule = Schedule.of(cfg)
        self._groups = groups
        self._apply_lr()

    def _apply_lr(self) -> float:
        lr = self.schedule.lr_at(self.schedule.step)
        for group in self._groups:
            group["lr"] = lr
        return lr

    # ------------------------------------------------------------------ micro-batches
    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """This data-parallel rank's micro-batches (sequence indices; [] = a weight-0 filler), equal in count
        on every rank; a multiple of p with virtual stages (the interleaved schedule runs them in groups of p)."""
        return rank_micro_batches(lengths, self.mb_max_tokens, dp=self.dp, dp_rank=self.dp_rank,
                                  agree=self._max_over_ranks, multiple_of=self.pp if self.vpp > 1 else 1)

    def _row(self, ids: torch.Tensor, lens: list[int], pad_to: int = 0) -> dict:
        """The model inputs of one packed row of sequences of ``lens`` (token ids ``ids``); padded to ``pad_to``
        tokens with a block of its own that no real token sees (``n`` says how many tokens are real)."""
        dev = self.device
        n = int(ids.numel())
        if pad_to > n:
            ids = torch.cat([ids, ids.new_zeros(pad_to - n)])
            lens = [*lens, pad_to - n]
        T = int(ids.numel())
        pos = torch.arange(T, device=dev)
        cu = torch.tensor([0, *cumsum(lens)], device=dev, dtype=torch.int32)
        starts = torch.zeros(T, dtype=torch.bool, device=dev)
        starts[cu[:-1].long()] = True
        ids = ids.to(dev, torch.long)
        row: dict = {"ids": ids, "starts": starts, "n": n, "args": (ids[None], pos[None]), "kwargs": {}}
        if self._te:
            # Transformer Engine's attention takes the packed row as THD with the sequence boundaries.
            from megatron.core.packed_seq_params import PackedSeqParams

            row["kwargs"]["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
            row["args"] += (None,)
        else:
            # The local attention takes any mask: block-diagonal causal, True = hidden (Megatron's sign).
            seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
            row["args"] += (((seq[:, None] != seq[None, :]) | (pos[None, :] > pos[:, None]))[None, None],)
        return row

    def _schedule(self, packed: Packed, plan: list[list[int]], temperature: float, on_last: Any,
                  forward_only: bool) -> None:
        """Megatron's pipeline schedule over the micro-batches of ``plan`` (sequence indices; [] = a filler).

        On the last stage ``on_last(i, logprobs, entropy)`` gets micro-batch ``i``'s float32 per-token values
        and returns the scalar to back-propagate (ignored when ``forward_only``). Every rank of the world
        calls it with the same number of micro-batches; activations and their gradients go between stages
        as the schedule says (one forward-backward with p1)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        lens = [packed.lens(seqs or [packed.shortest]) for seqs in plan]
        longest = max(sum(row) for row in lens)
        # Virtual stages: one length for every row of the batch (convert.transformer_config says why).
        pad_to = longest if self.vpp > 1 else 0
        # Rows are made when a chunk first needs them and dropped after this rank's last chunk has run them
        # forward: a row's [T, T] mask is not kept for every micro-batch of the batch at once.
        rows: dict[int, dict] = {}
        tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        counted = torch.ones((), dtype=torch.int)  # the schedule's token count, unused (no finalize function)

        def forward_step(data: Iterator[tuple[int, int]], model: Any) -> tuple[torch.Tensor, Any]:
            i, chunk = next(data)
            if i not in rows:
                rows[i] = self._row(packed.ids[packed.token_index(plan[i] or [packed.shortest])], lens[i], pad_to)
            row = rows.pop(i) if chunk == self.vpp - 1 else rows[i]
            output = model(*row["args"], **row["kwargs"])
            if not (self.last_stage and chunk == self.vpp - 1):
                # Hidden states [s, 1, h] to the next stage, in the dtype its receive buffer has.
                return output.to(self.tf_config.pipeline_dtype), None

            def loss(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:  # [1, T, V'/t]
                local = logits.shape[-1]
                logprobs, entropy = vocab_parallel_logprobs(
                    logits[0], row["ids"], row["starts"], vocab_start=self.tp_rank * local,
                    vocab_size=self.hf_config.vocab_size, temperature=temperature, tp_group=tp_group,
                    chunk=self.options.logits_chunk_tokens)
                return on_last(i, logprobs[:row["n"]], entropy[:row["n"]]), counted, {}

            return output, loss

        run = get_forward_backward_func(pp_size=self.pp, vp_size=self.vpp if self.vpp > 1 else None)
        cast = torch.autocast(self.device.type, dtype=self.dtype) if self._autocast else nullcontext()
        with cast, self._cuda_context(), (torch.no_grad() if forward_only else nullcontext()):
            run(forward_step_func=forward_step, model=self.model,
                data_iterator=[iter([(i, v) for i in range(len(plan))]) for v in range(self.vpp)],
                num_microbatches=len(plan), seq_length=longest,
                micro_batch_size=1, forward_only=forward_only)

    # ------------------------------------------------------------------ one optimizer step
    def _optimizer_step(self, batch: dict, loss_fn: Any, temperature: float, update_step: int, lr: float) -> dict:
        """One optimizer step on ``batch`` (one mini-batch of an update); its stats."""
        packed = Packed(batch, "MegatronEngine")
        plan = self._plan(packed.lengths)
        mask = packed.tensors.get("loss_mask")
        total = int(mask.sum()) if mask is not None else packed.T
        records: list[tuple[int, float, dict]] = []

        def weighted_loss(i: int, logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            seqs = plan[i]
            mb = packed.micro_batch(seqs or [packed.shortest])
            n_loss = (int(mb["loss_mask"].sum()) if "loss_mask" in mb else len(mb["token_index"])) if seqs else 0
            if n_loss == 0 or total == 0:
                return logprobs.sum() * 0.0  # a filler: every collective and send of the backward still runs
            mb[UPDATE_STEP_KEY] = update_step
            loss, stats = loss_fn(logprobs, entropy, mb)
            scaled = loss * (n_loss / total)
            if not scaled.requires_grad:
                scaled = scaled + logprobs.sum() * 0.0
            records.append((n_loss, float(loss.detach()), scalar_stats(stats)))
            return scaled

        self._zero_grad()
        for chunk in self.model:
            chunk.train()
        try:
            self._schedule(packed, plan, temperature, weighted_loss, forward_only=False)
        finally:
            for chunk in self.model:
                chunk.eval()
        grad_norm, skipped = self._step()
        if self.world > 1:
            # The loss ran on the last pipeline stage only: every rank gets its records (once per data rank).
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, records if self.tp_rank == 0 else [])
            records = [r for rank_records in gathered for r in rank_records]
        out = combine_stats(records, total)
        out.update(grad_norm=grad_norm, lr=lr, n_tokens=float(packed.T), n_loss_tokens=float(total),
                   n_micro_batches=float(len(plan)), update_skipped=float(skipped))
        return out

    def _zero_grad(self) -> None:
        if self.cpu:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()

    def _step(self) -> tuple[float, bool]:
        """Reduce, clip and apply the gradients: (norm before clipping, whether the step was skipped)."""
        if not self.cpu:
            from megatron.core.distributed import finalize_model_grads

            # Data-parallel reduction of every chunk and the tied embedding's gradient between the first and
            # last stage; no token count (the loss weights already sum to 1 over the batch).
            finalize_model_grads(self.model, num_tokens=None)
            ok, norm, _ = self.optimizer.step()
            return float(norm) if norm is not None else 0.0, not ok
        params = [p for p in self._parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.dp_group)  # loss weights already sum to 1 over the data ranks
            torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        self._sync_tied_embedding_grad()
        squares = torch.zeros(1, dtype=torch.float64)
        for p in params:
            # Tensor-parallel shards count on every rank, replicated tensors (norms) once, and the last
            # stage's copy of a tied embedding not at all (the first stage counts it).
            if getattr(p, "shared", False):
                continue
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                squares += p.grad.double().pow(2).sum()
        if self.tp * self.pp > 1:
            from megatron.core import parallel_state as ps

            dist.all_reduce(squares, group=ps.get_model_parallel_group())  # over tensor ranks and stages
        norm = float(squares.sqrt())
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, True
        if self.grad_clip > 0 and norm > self.grad_clip:
            for p in params:
                p.grad.mul_(self.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, False

    def _sync_tied_embedding_grad(self) -> None:
        """CPU, p > 1, tied embeddings: the first stage's embedding and the last stage's copy of it (the output
        layer) each hold part of the gradient; both get the sum, so the two copies take the same step."""
        from megatron.core import parallel_state as ps

        if self.pp == 1 or not self.tied or not ps.is_rank_in_embedding_group():
            return
        chunk = self.chunks[0] if self.first_stage else self.chunks[-1]
        weight = chunk.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())
