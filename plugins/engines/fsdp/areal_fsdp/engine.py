"""The ``fsdp`` train engine: any HF causal LM, sharded with FSDP2 over the data-parallel ranks.

One engine per rank. :class:`FSDPEngine` sets itself up, plans micro-batches,
runs the forward and the train step here; the rest is split by what it owns:

- :mod:`areal_fsdp.model`: the HF model loaded and wrapped as the FSDP root (value head for a critic);
- :mod:`areal_fsdp.parallel`: the ``(dp, cp, tp)`` device mesh, tensor parallel, FSDP2 sharding;
- :mod:`areal_fsdp.export`: weights out, to disk or as tensor buckets;
- :mod:`areal_fsdp.checkpoint`: save and load.

What every train engine builds the same way (run config, device, micro-batch
plan, AdamW groups, the LR schedule, HF folders, the packed batch) comes from
:mod:`areal_core.engine_kit` and :class:`areal_core.train_batches.Packed`.

Precision: parameters (the optimizer's master copy) are float32 for the
actor. ``model.dtype: bfloat16`` computes in bfloat16: through FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when sharded,
through ``torch.autocast`` when not. Logprobs and entropy are always float32.
A reference engine (frozen, no optimizer) keeps its parameters in
``model.dtype``.

Batches are the trainer's packed lists (see ``areal_core.rollout.pack_groups``).
Sequences are shared among data-parallel ranks (the c x t ranks of one
context / tensor-parallel block get the same ones) with balanced token
counts, then packed into as many micro-batches as the fullest rank needs
under ``actor.mb_max_tokens``, agreed with an all-reduce
(:func:`areal_core.engine_kit.packing.rank_micro_batches`); each micro-batch
is one row with a block-diagonal causal mask (:mod:`areal_fsdp.logprobs`). A
rank with fewer sequences than micro-batches runs its spare ones on the
batch's shortest sequence with weight 0, so every rank joins every collective.

Loss normalisation: ``loss_fn`` returns the token mean over a micro-batch's
``loss_mask`` tokens; the engine weights it by (those tokens / the batch's
loss tokens), so the summed gradient is the gradient of the batch's token
mean, whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

import math
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal_core.api import TrainEngine
from areal_core.engine_kit import setup
from areal_core.engine_kit.optim import Schedule, adamw_kwargs, parameter_groups
from areal_core.engine_kit.packing import rank_micro_batches
from areal_core.train_batches import (UPDATE_STEP_KEY, Packed, as_list, combine_stats, merge_update_stats, scalar_stats,
                                      to_tensor, update_batches)
from areal_fsdp import attention, context
from areal_fsdp.checkpoint import CheckpointMixin
from areal_fsdp.export import ExportMixin
from areal_fsdp.logprobs import packed_attention_mask, sequence_ids
from areal_fsdp.lora import add_lora, lora_layers
from areal_fsdp.model import (_attach_value_head, _LogprobModel, _tied_aliases, _ValueModel, checkpoint_activations,
                              load_lm)
from areal_fsdp.parallel import ParallelMixin
from areal_fsdp.prefix import SharedRow, attention_plan, group_units, share_prefixes

ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
EXPORT_WAIT_S = 600.0  # the longest an optimizer step waits for an export still being read, and vice versa


@dataclass
class FSDPEngineConfig:
    """Keys of ``actor`` when ``actor.backend: fsdp`` (beside the core's optimizer, mb_max_tokens, ...)."""

    attn_implementation: str = field(default="sdpa", metadata={
        "choices": list(ATTENTION),
        "help": "sdpa / eager: packed sequences get a block-diagonal mask; flash_attention_*: (GPU) "
                "sequences are separated by their restarting position ids"})
    logits_chunk_tokens: int = field(default=1024, metadata={
        "ge": 1, "help": "positions whose full-vocabulary float32 logits are computed at once"})
    share_prefixes: bool = field(default=True, metadata={
        "help": "run tokens that several sequences of a micro-batch start with (a group's prompt) once, the "
                "micro-batch laid out as a prefix tree (areal_fsdp.prefix; exact); sdpa attention without context "
                "parallel"})
    reshard_after_forward: bool = field(default=True, metadata={
        "help": "free each layer's gathered weights after its forward (less memory, one more all-gather)"})
    lora_rank: int = field(default=0, metadata={
        "ge": 0, "help": "LoRA rank (through PEFT, the 'lora' extra): train adapters only; 0 = train every weight"})
    lora_alpha: float = field(default=16.0, metadata={
        "gt": 0.0, "help": "LoRA alpha: the adapters' update is scaled by alpha / rank"})
    lora_dropout: float = field(default=0.0, metadata={
        "ge": 0.0, "lt": 1.0, "help": "dropout on the adapters' input while training (off in forward_logprobs)"})
    lora_target_modules: list = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "module names given adapters (e.g. [q_proj, v_proj]); ['all-linear'] = every linear but the head"})
    lora_export: str = field(default="merged", metadata={
        "choices": ["merged", "adapter"],
        "help": "what export_to_disk writes with LoRA: merged full weights (what inference engines load) or the "
                "adapters only in PEFT format (for engines that load adapters); export_tensors is always merged"})


class FSDPEngine(ParallelMixin, ExportMixin, CheckpointMixin, TrainEngine):
    """Train engine on PyTorch FSDP2 (``actor.backend: fsdp``). See the module docstring."""

    config_class = FSDPEngineConfig
    capabilities = frozenset({"save_load", "export_disk", "export_tensors", "export_beside_training", "export_into",
                              "reference", "critic", "minibatches"})

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.options: FSDPEngineConfig = self.context.options or FSDPEngineConfig()
        self.role: str = self.context.extras.get("role", "actor")
        if self.role not in ("actor", "reference", "critic"):
            raise ValueError(f"FSDPEngine: role {self.role!r} is not 'actor', 'reference' or 'critic'")
        self._version = 0
        self.model: _LogprobModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self._peft: Any = None  # the PEFT model around self.lm when LoRA is on
        self._lora_layers: dict[str, tuple[float, bool]] = {}
        # Held by an export from its call until its last bucket is read; an optimizer step waits for it
        # ("export_beside_training": another thread may read the export while this one trains).
        self._export_lock = threading.Lock()

    # ------------------------------------------------------------------ setup
    @property
    def version(self) -> int:
        return self._version

    @property
    def lm(self) -> nn.Module:
        """The HF causal LM (its parameters are DTensor shards when the world is larger than 1)."""
        self._require_model("lm")
        return self.model.lm

    # ``model.path`` as a local HF folder (a class attribute: tests see which dtype's copy is asked for)
    _model_path = staticmethod(setup.model_folder)

    def initialize(self) -> None:
        if self.model is not None:
            return
        cfg = setup.run_config(self.context)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.tp, self.cp = self._model_parallel_sizes()
        # rank = (dp_rank * cp + cp_rank) * tp + tp_rank: the ranks of one context / tensor group share micro-batches
        self.dp, self.dp_rank = self.world // (self.cp * self.tp), self.rank // (self.cp * self.tp)
        self.cp_rank = self.rank // self.tp % self.cp
        self.device = self._pick_device()
        self.dtype = getattr(torch, cfg.model.dtype)
        trained = self.role in ("actor", "critic")
        master = torch.float32 if trained else self.dtype
        # A trained role asks for the float32 copy where a plugin converts the model per dtype (the demo model):
        # an upcast bf16 copy puts every master weight on the bf16 grid, where bf16 compute misses every update
        # smaller than half a bf16 step.
        self.source = self._model_path(cfg.model.path, "float32" if trained else cfg.model.dtype)
        self.mb_max_tokens = int(cfg.actor.mb_max_tokens)
        lm = load_lm(self.source, master, self.options.attn_implementation, self.cp)
        if self.role == "actor" and cfg.actor.gradient_checkpointing:
            checkpoint_activations(lm)
        if self.role == "reference":
            lm.requires_grad_(False)
        o = self.options
        self._peft = add_lora(lm, o.lora_rank, o.lora_alpha, o.lora_dropout, o.lora_target_modules, cfg.trainer.seed) \
            if o.lora_rank > 0 and self.role == "actor" else None
        self._lora_layers = lora_layers(lm) if self._peft is not None else {}
        if self.role == "critic":
            if self.tp > 1:
                raise NotImplementedError("FSDPEngine: a critic with tensor parallel is not built; place the critic's "
                                          "engine with data parallel (d) only")
            _attach_value_head(lm, cfg.trainer.seed)
        self._aliases = _tied_aliases(lm)
        model_cls = _ValueModel if self.role == "critic" else _LogprobModel
        model = model_cls(lm, self.options.logits_chunk_tokens)
        if self.world > 1:
            self.mesh = self._device_mesh()
        if self.tp > 1:
            self._tensor_parallel(model)
        if self.dp * self.cp > 1:
            self._shard(model)
        if self.world == 1:
            model.to(self.device)
        self.model = model.eval()
        # Autocast when nothing else casts: bf16 compute over float32 parameters without FSDP.
        self._autocast = self.dp * self.cp == 1 and master != self.dtype
        if trained:
            self._build_optimizer(cfg)
        layout = " x ".join([f"tensor parallel t{self.tp}"] * (self.tp > 1)
                            + [f"context parallel c{self.cp}"] * (self.cp > 1)
                            + [f"FSDP data parallel d{self.dp}"] * (self.dp > 1)) or "one process"
        if self.cp > 1:
            layout += f" (FSDP shards over d{self.dp} x c{self.cp})"
        print(f"areal-plugin-fsdp: {self.role} rank {self.rank}/{self.world} on {self.device}, {layout}, "
              f"{cfg.model.dtype}, attention {self.lm.config._attn_implementation}", file=sys.stderr, flush=True)

    def _pick_device(self) -> torch.device:
        wanted = getattr(self.context.placement, "device", None)
        if wanted != "cpu" and torch.cuda.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
                and "nccl" not in str(dist.get_backend()):
            # FSDP's collectives on CUDA tensors through a gloo-only group crash the ranks (SIGSEGV).
            raise RuntimeError(f"FSDPEngine: torch.distributed was initialised with backend "
                               f"{dist.get_backend()!r}, which cannot reduce CUDA tensors, and this rank would "
                               f"train on cuda; initialise it with 'cpu:gloo,cuda:nccl' (as areal's trainer does) "
                               f"or place the actor with '@cpu'")
        return setup.pick_device(self.context, "FSDPEngine")

    def _build_optimizer(self, cfg: Any) -> None:
        o = cfg.actor.optimizer
        # The fused kernel on plain (unsharded) tensors, the fastest; sharded (DTensor) parameters keep the default.
        self.optimizer = torch.optim.AdamW(parameter_groups(self.model.parameters(), o.weight_decay),
                                           **adamw_kwargs(o), fused=self.world == 1 or None)
        self.grad_clip = float(o.grad_clip)
        # torch's LambdaLR over the kit's schedule: its state_dict is what saved checkpoints hold
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, Schedule.of(cfg).factor)

    def _require_model(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"FSDPEngine.{what}: the engine is not initialized (call initialize() first) "
                               f"or was closed")

    # ------------------------------------------------------------------ batches
    def _plan(self, batch: dict) -> list[list[int]]:
        """This rank's micro-batches (lists of sequence indices; [] = a weight-0 filler) and their count."""
        lengths = [int(n) for n in as_list(batch["seq_lens"])] if "seq_lens" in batch else \
            [b - a for a, b in zip(as_list(batch["cu_seqlens"])[:-1], as_list(batch["cu_seqlens"])[1:])]
        if not lengths:
            raise ValueError("FSDPEngine: the batch holds no sequences")
        units, costs = self._units(batch, lengths)
        bins = rank_micro_batches(costs, self.mb_max_tokens, dp=self.dp, dp_rank=self.dp_rank,
                                  agree=self._max_over_ranks)
        return [sorted(s for u in b for s in units[u]) for b in bins]

    @property
    def _shares_prefixes(self) -> bool:
        """Whether micro-batches run as prefix trees: the option on, the per-sequence sdpa path (whose plan
        carries the tree), no context parallel (its rows are split by position, not by sequence)."""
        return (self.options.share_prefixes and self.cp == 1
                and self.lm.config._attn_implementation == attention.PACKED_SDPA)

    def _units(self, batch: dict, lengths: list[int]) -> tuple[list[list[int]], list[int]]:
        """What the planner places whole and what each costs: each sequence alone, or with shared prefixes on,
        the samples of one group together (:func:`areal_fsdp.prefix.group_units`)."""
        if not (self._shares_prefixes and "group_index" in batch):
            return [[i] for i in range(len(lengths))], lengths
        return group_units(to_tensor("input_ids", batch["input_ids"]), lengths, as_list(batch["group_index"]),
                           self.mb_max_tokens)

    def _on_device(self, mb: dict) -> dict:
        """The micro-batch as ``loss_fn`` sees it: its tensors on the engine's device, beside the logprobs."""
        if self.device.type == "cpu":
            return mb
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}

    def _forward(self, mb: dict, temperature: float,
                 only: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [T_mb], entropy [T_mb]) float32 of one packed micro-batch (``only``: just those tokens)."""
        if self.cp > 1:
            return self._forward_context(mb, temperature, only)
        lens = mb["seq_lens"].tolist()
        dev = self.device
        starts = torch.zeros(sum(lens), dtype=torch.bool)
        starts[mb["cu_seqlens"][:-1]] = True
        impl = self.lm.config._attn_implementation
        extra: dict = {}
        if self._shares_prefixes:
            shared = share_prefixes(mb["input_ids"], mb["position_ids"], lens)
            if shared is not None:
                return self._forward_shared(mb, shared, starts, temperature, only)
        if impl == attention.PACKED_SDPA:
            mask, extra[attention.CU_SEQLENS] = None, mb["cu_seqlens"].tolist()
        elif impl.startswith("flash_attention"):
            mask = None  # transformers separates packed sequences by their restarting position ids
        else:
            mask = self._mask(lens, impl)
        ids = mb["input_ids"].to(dev, torch.long)[None]
        pos = mb["position_ids"].to(dev, torch.long)[None]
        if only is not None:
            only = only.to(dev)
        cast = torch.autocast(dev.type, dtype=self.dtype) if self._autocast else nullcontext()
        with cast:
            return self.model(ids, pos, mask, starts.to(dev), temperature, only, **extra)

    def _forward_shared(self, mb: dict, shared: SharedRow, starts: torch.Tensor, temperature: float,
                        only: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_forward` with shared prefixes laid out once (:mod:`areal_fsdp.prefix`): the model runs the
        shorter row, and each of the batch's tokens is scored from the row position ``shared.scorer`` names."""
        dev = self.device
        extra = {attention.PLAN: attention_plan(shared, dev)}
        cast = torch.autocast(dev.type, dtype=self.dtype) if self._autocast else nullcontext()
        with cast:
            return self.model(shared.input_ids.to(dev)[None], shared.position_ids.to(dev)[None], None,
                              starts.to(dev), temperature, None if only is None else only.to(dev),
                              targets=mb["input_ids"].to(dev, torch.long), scorer=shared.scorer.to(dev), **extra)

    def _forward_context(self, mb: dict, temperature: float,
                         only: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_forward` of this rank's share of the row (see :mod:`areal_fsdp.context`), the whole row returned.

        Targets, sequence starts and ``only`` are taken from the whole row before
        it is split, so the last token of a chunk still scores the first token
        of the next one; position ids restart per sequence on the whole row too.
        The padding (up to a multiple of 2c) is a sequence of its own that
        nothing scores. Each rank's per-position values are all-gathered
        (differentiably: every cp rank then holds the same full row and computes
        the same loss) and put back in row order.
        """
        dev = self.device
        lens = mb["seq_lens"].tolist()
        T = sum(lens)
        pad = context.padded_length(T, self.cp) - T
        ids = mb["input_ids"].to(torch.long)
        starts = torch.zeros(T, dtype=torch.bool)
        starts[mb["cu_seqlens"][:-1]] = True
        # Position p scores token p + 1: its id, whether it starts a sequence (nothing to score), whether wanted.
        targets = F.pad(ids[1:], (0, pad + 1))
        no_target = F.pad(starts[1:], (0, pad + 1), value=True)
        wanted = None if only is None else F.pad(only.bool().cpu()[1:], (0, pad + 1))
        seq = torch.cat([sequence_ids(lens), torch.full((pad,), len(lens), dtype=torch.long)])
        shard = context.ContextShard(seq.to(dev), self.cp, self.cp_rank, self.mesh["cp"].get_group())

        def local(x: torch.Tensor) -> torch.Tensor:
            return shard.split(x.to(dev))

        row = (local(F.pad(ids, (0, pad)))[None], local(F.pad(mb["position_ids"].to(torch.long), (0, pad)))[None])
        cast = torch.autocast(dev.type, dtype=self.dtype) if self._autocast else nullcontext()
        with cast:
            lp, ent = self.model(*row, None, local(no_target), temperature, None if wanted is None else local(wanted),
                                 targets=local(targets), **{context.SHARD: shard})
        both = shard.gather_row(torch.stack([lp.float(), ent.float()]), 1)[:, :T - 1]  # [2, T - 1]
        both = F.pad(both, (1, 0))  # token t's values come from position t - 1; the row's first token gets 0.0
        return both[0], both[1]

    def _mask(self, lens: list[int], impl: str) -> Any:
        additive = None if impl == "sdpa" else self.dtype  # eager adds the mask to scores in the compute dtype
        mask = packed_attention_mask(lens, additive_dtype=additive, device=self.device)
        config = self.lm.config
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types and window is not None:
            sliding = packed_attention_mask(lens, additive_dtype=additive, device=self.device, sliding_window=window)
            return {"full_attention": mask, "sliding_attention": sliding}
        return mask

    # ------------------------------------------------------------------ the contract
    def forward_logprobs(self, batch: dict, temperature: float = 1.0) -> dict:
        """Per-token ``logprobs`` and ``entropy`` (CPU float32 tensors of T values, 0.0 at each sequence's first
        token: the batch keeps them as they are, no list in between).

        Collective when the world is larger than 1: every rank computes its
        share and every rank returns the whole batch's values.
        """
        self._require_model("forward_logprobs")
        packed = Packed(batch, "FSDPEngine")
        plan = self._plan(batch)
        logprobs = torch.zeros(packed.T, dtype=torch.float32)
        entropy = torch.zeros(packed.T, dtype=torch.float32)
        with torch.no_grad():
            for seqs in plan:
                mb = packed.micro_batch(seqs or [packed.shortest], with_positions=True)
                lp, ent = self._forward(mb, temperature)
                if seqs:
                    logprobs[mb["token_index"]] = lp.float().cpu()
                    entropy[mb["token_index"]] = ent.float().cpu()
        if self.dp > 1:
            both = torch.stack([logprobs, entropy]).to(self._comm_device())
            dist.all_reduce(both, group=self._dp_group())  # one dp rank computes each token; the others add 0
            logprobs, entropy = both.cpu()
        return {"logprobs": logprobs, "entropy": entropy}

    def forward_values(self, batch: dict) -> dict:
        """Critic: per-token ``values`` (a CPU float32 tensor of T; ``values[t]`` read from token ``t - 1``, 0.0 at
        starts)."""
        self._require_role("critic", "forward_values")
        return {"values": self.forward_logprobs(batch)["logprobs"]}  # the value model returns values there

    def train_values(self, batch: dict, loss_fn: Any, epochs: int = 1) -> dict:
        """Critic: one update as train_batch's, ``loss_fn(values, mb) -> (token-mean loss, stats)``, weighted alike."""
        self._require_role("critic", "train_values")
        return self.train_batch(batch, lambda values, _entropy, mb: loss_fn(values, mb), epochs=epochs)

    def _require_role(self, role: str, what: str) -> None:
        self._require_model(what)
        if self.role != role:
            raise RuntimeError(f"FSDPEngine.{what}: this engine has role {self.role!r}; build it with role {role!r}")

    def train_batch(self, batch: dict, loss_fn: Any, temperature: float = 1.0, epochs: int = 1) -> dict:
        """One policy update on ``batch``: an optimizer step per mini-batch (``batch["minibatch"]``; the whole
        batch without it) for each of ``epochs`` passes, then the schedule's step and ``version`` + 1.
        ``loss_fn(logprobs, entropy, mb) -> (loss, stats)``.

        ``logprobs`` / ``entropy``: float32 [T_mb] with grad, over the micro-batch's
        tokens; ``mb``: the batch's per-token keys as tensors over the same
        tokens (``loss_mask`` bool, float lists float32, int lists int64),
        per-sequence keys over its sequences, ``seq_lens`` / ``cu_seqlens`` of the
        micro-batch and ``token_index`` (its tokens' positions in the batch).
        ``loss`` must be the token mean over ``mb["loss_mask"]``.

        Returns floats: ``loss`` (the batch's token mean), ``grad_norm``
        (before clipping), ``lr``, ``n_tokens``, ``n_loss_tokens``,
        ``n_micro_batches``, ``update_skipped`` (1 when the gradient was not
        finite and no step was taken), and the loss-token-weighted mean of
        every stat ``loss_fn`` returned; over several optimizer steps, each
        stat's mean over them (:func:`areal_core.train_batches.merge_update_stats`)
        and ``n_optimizer_steps``. ``mb["update_step"]``: the steps already
        taken in this update.
        """
        self._require_model("train_batch")
        if self.optimizer is None:
            raise RuntimeError(f"FSDPEngine.train_batch: this engine has role {self.role!r} (a frozen copy with no "
                               f"optimizer); only engines built with role 'actor' or 'critic' train")
        steps = [self._optimizer_step(part, loss_fn, temperature, j)
                 for j, part in enumerate(update_batches(batch, epochs))]
        self.scheduler.step()  # once per update: the schedule counts versions, not optimizer steps
        self._version += 1
        return merge_update_stats(steps, epochs)

    def _optimizer_step(self, batch: dict, loss_fn: Any, temperature: float, update_step: int) -> dict:
        """One optimizer step on ``batch`` (one mini-batch of an update); its stats."""
        packed = Packed(batch, "FSDPEngine")
        plan = self._plan(batch)
        T = packed.T
        mask = packed.tensors.get("loss_mask")
        total_loss_tokens = int(mask.sum()) if mask is not None else T
        records: list[tuple[int, float, dict]] = []
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over from a step that raised
        self.model.train()
        try:
            for seqs in plan:
                mb = packed.micro_batch(seqs or [packed.shortest], with_positions=True)
                # Only the loss tokens: loss_fn sees 0.0 elsewhere (the contract's "token mean over loss_mask").
                logprobs, entropy = self._forward(mb, temperature, mb.get("loss_mask"))
                n_loss = (int(mb["loss_mask"].sum()) if "loss_mask" in mb else len(mb["token_index"])) if seqs else 0
                if n_loss == 0 or total_loss_tokens == 0:
                    # No loss tokens: a zero gradient, but every FSDP collective still runs.
                    (logprobs.sum() * 0.0).backward()
                    continue
                mb[UPDATE_STEP_KEY] = update_step
                loss, stats = loss_fn(logprobs, entropy, self._on_device(mb))
                weight = n_loss / total_loss_tokens
                # FSDP averages gradients over the dp x cp ranks it shards over; scaling by dp makes that a sum
                # over dp. The cp ranks of a group compute the same loss on the same gathered row, and the
                # gather's backward sums their cp equal gradients, which the average over cp undoes.
                scaled = loss * (weight * self.dp)
                if not scaled.requires_grad:
                    scaled = scaled + logprobs.sum() * 0.0
                scaled.backward()
                records.append((n_loss, float(loss.detach()), scalar_stats(stats)))
        finally:
            self.model.eval()
        grad_norm = self._clip()
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            with self._weights_unread():
                self.optimizer.step()
        self.optimizer.grad_scale = None  # the clip's scale (_clip) is for this step only
        self.optimizer.zero_grad(set_to_none=True)
        if self.dp > 1:
            gathered: list[Any] = [None] * self.dp
            dist.all_gather_object(gathered, records, group=self._dp_group())
            records = [r for rank_records in gathered for r in rank_records]
        out = combine_stats(records, total_loss_tokens)
        out.update(grad_norm=grad_norm, lr=lr, n_tokens=float(T), n_loss_tokens=float(total_loss_tokens),
                   n_micro_batches=float(len(plan)), update_skipped=float(skipped))
        return out

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        if self.tp > 1:
            return self._clip_tensor_parallel(params, max_norm)
        # The fused AdamW kernel divides each gradient by the optimizer's ``grad_scale`` (the attribute torch's
        # GradScaler sets) as it reads it, so clipping there costs no pass of its own over the gradients. The
        # groups' own flag decides, as it does for step(): a loaded checkpoint of a sharded run keeps the default.
        if all(group.get("fused") for group in self.optimizer.param_groups):
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False))
            coef = max_norm / (norm + 1e-6)  # clip_grad_norm_'s coefficient
            self.optimizer.grad_scale = torch.tensor(1.0 / coef, device=self.device) if coef < 1.0 else None
            return norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _hold_weights(self, what: str, waiting_for: str) -> None:
        """Take the export lock (see ``__init__``), waiting at most ``EXPORT_WAIT_S``."""
        if not self._export_lock.acquire(timeout=EXPORT_WAIT_S):
            raise TimeoutError(f"FSDPEngine.{what}: waited {EXPORT_WAIT_S:.0f} s {waiting_for}")

    @contextmanager
    def _weights_unread(self) -> Iterator[None]:
        """Hold off writing the weights while an export (maybe on another thread) has not read them all."""
        self._hold_weights("train_batch", "before the optimizer step for an export_tensors() whose buckets were "
                                          "neither all read nor closed")
        try:
            yield
        finally:
            self._export_lock.release()

    def close(self) -> None:
        self.model = None
        self.optimizer = None
        self.scheduler = None

