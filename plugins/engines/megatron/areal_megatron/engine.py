"""The ``megatron`` train engine: HF Llama / Qwen2 as a Megatron-Core ``GPTModel``, tensor x pipeline x data parallel.

One engine per rank. :class:`MegatronEngine` builds its model chunks and runs
the contract (``forward_logprobs``, ``train_batch``) here; the rest is split
by what it owns:

- :mod:`areal_megatron.parallel`: parallel sizes, Megatron's parallel state, the device context;
- :mod:`areal_megatron.steps`: micro-batches, Megatron's schedule, the optimizer and its step;
- :mod:`areal_megatron.checkpoint`: HF weights in, exports and checkpoints out;
- :mod:`areal_megatron.convert`: HF <-> Megatron names and shards, the ``GPTModel`` and its config;
- :mod:`areal_megatron.logprobs`: logprobs and entropy from vocab-parallel logits;
- :mod:`areal_megatron.cpu`: what Megatron needs to run on CPU.

What every train engine builds the same way (run config, device, micro-batch
plan, AdamW groups, the LR schedule, HF folders, the packed batch) comes from
:mod:`areal_core.engine_kit` and :class:`areal_core.train_batches.Packed`.

The world is the launcher's ``torch.distributed`` group (gloo on CPU, nccl
on GPU), split by Megatron's ``parallel_state`` into tensor-parallel groups
of ``t``, pipeline groups of ``p`` stages (the allocation's
``megatron:d..p..t..``) and data-parallel groups of ``world / (t p)``. With
``actor.virtual_pipeline_size`` v > 1 each stage holds v chunks of layers
(Megatron's interleaved schedule). Context and expert parallel are declared
to the plan check but not built: :meth:`MegatronEngine.initialize` refuses
them, and ``areal check`` reports them (``megatron.not-built``, reasons in
:data:`areal_megatron.hooks.UNBUILT`).

Weights: each rank keeps its tensor-parallel shard of its stage's layers,
found by each layer's place in the whole model
(:func:`areal_megatron.convert.stage_names`): the embedding on the first
stage, final norm and output layer on the last. A tied embedding also lives
on the last stage as its output layer (Megatron's copy); the two copies'
gradients are summed before every step, so they stay equal (Megatron's
``finalize_model_grads`` on GPU, the engine on CPU). Parameters are float32
for the actor (the optimizer's master copy); ``model.dtype: bfloat16``
computes under ``torch.autocast`` on GPU (on CPU Megatron's linear layers
cannot: the actor refuses it there). A reference engine keeps its parameters
in ``model.dtype``.

Batches are the trainer's packed lists. Sequences are shared among the
data-parallel ranks with balanced token counts, then packed into
micro-batches of at most ``actor.mb_max_tokens`` tokens (the count agreed
over the world); the tensor-parallel ranks of one data-parallel rank run the
same micro-batches. Each micro-batch is one row with a block-diagonal causal
mask (Megatron's local attention takes an arbitrary mask; rotary phases only
depend on the distance between tokens of one sequence, so the row's
positions need not restart); with ``transformer_engine: true`` on GPU the
row goes to Transformer Engine's attention as THD ``packed_seq_params``.

Micro-batches run through Megatron's own schedule
(``get_forward_backward_func``: no pipelining at p1, 1F1B, or interleaved
with virtual stages); activations go between stages with their shapes, since
packed rows differ in length (with virtual stages, padded to one length per
batch: :func:`areal_megatron.convert.transformer_config` says why). The
logprobs, the entropy and ``loss_fn`` run on the last stage; per-token
logprobs and train statistics are then shared with every rank, so every
caller sees what it would see at p1.

Loss normalisation as in the fsdp engine: ``loss_fn`` returns the token mean
over a micro-batch's ``loss_mask`` tokens and is weighted by (those tokens /
the batch's loss tokens); gradients are summed over data-parallel ranks, so
the step does not depend on the split.

Optimizer: one per stage. On CPU ``torch.optim.AdamW`` with the gradients
all-reduced over the data-parallel group and the norm taken over
tensor-parallel shards and pipeline stages (:mod:`areal_megatron.cpu` says
why); on GPU Megatron's own ``DistributedDataParallel`` per chunk,
``finalize_model_grads`` and ``get_megatron_optimizer`` (the distributed
optimizer, clipping inside). Learning rate: warmup then constant, linear or
cosine decay, as ``actor.optimizer`` says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from areal_core.api import TrainEngine
from areal_core.engine_kit import setup
from areal_core.train_batches import Packed, merge_update_stats, update_batches
from areal_megatron import convert
from areal_megatron.checkpoint import CheckpointMixin
from areal_megatron.parallel import ParallelMixin
from areal_megatron.steps import StepsMixin


@dataclass
class MegatronEngineConfig:
    """Keys of ``actor`` when ``actor.backend: megatron`` (beside the core's optimizer, mb_max_tokens, ...)."""

    virtual_pipeline_size: int = field(default=1, metadata={
        "ge": 1, "help": "interleaved pipeline chunks per stage (needs p > 1; p x this must divide the layers)"})
    logits_chunk_tokens: int = field(default=1024, metadata={
        "ge": 1, "help": "positions whose float32 vocab-parallel log-softmax is computed at once"})
    transformer_engine: bool = field(default=False, metadata={
        "help": "GPU with transformer_engine installed: Transformer Engine's layer spec, packed rows as THD "
                "(not verified here yet); false: Megatron's local layers with a block-diagonal mask"})


class MegatronEngine(ParallelMixin, StepsMixin, CheckpointMixin, TrainEngine):
    """Train engine on Megatron-Core (``actor.backend: megatron``). See the module docstring."""

    config_class = MegatronEngineConfig
    capabilities = frozenset({"save_load", "export_disk", "export_tensors", "reference", "minibatches"})

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.options: MegatronEngineConfig = self.context.options or MegatronEngineConfig()
        self.role: str = self.context.extras.get("role", "actor")
        if self.role not in ("actor", "reference"):
            raise ValueError(f"MegatronEngine: role {self.role!r} is not 'actor' or 'reference'")
        self._version = 0
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ setup
    def initialize(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig

        cfg = setup.run_config(self.context)
        self.tp, self.pp = self._parallel_sizes()
        self.device = setup.pick_device(self.context, "MegatronEngine")
        self.cpu = self.device.type == "cpu"
        self.dtype = getattr(torch, cfg.model.dtype)
        # The actor's float32 master weights come from the float32 copy where a plugin converts per dtype (the
        # demo model): an upcast bf16 copy would sit on the bf16 grid (see areal_fsdp.engine, same reason).
        self.source = setup.model_folder(cfg.model.path, "float32" if self.role == "actor" else cfg.model.dtype)
        self.hf_config = AutoConfig.from_pretrained(self.source)
        convert.check_architecture(self.hf_config)
        self.vpp = self._virtual_pipeline_size()
        self._init_parallel_state(cfg)
        self.mb_max_tokens = int(cfg.actor.mb_max_tokens)
        master = torch.float32 if self.role == "actor" else self.dtype
        if self.cpu and master != self.dtype:
            raise NotImplementedError(
                f"MegatronEngine: model.dtype {cfg.model.dtype} over float32 master weights needs mixed precision, "
                f"which Megatron's CPU linear layers do not support (their backward mixes dtypes under autocast); "
                f"set model.dtype: float32 on CPU, or run on GPU")
        recompute = self.role == "actor" and bool(cfg.actor.gradient_checkpointing)
        tf_config = convert.transformer_config(self.hf_config, tp=self.tp, pp=self.pp, vpp=self.vpp,
                                               params_dtype=master, cpu=self.cpu, recompute=recompute and not self.cpu)
        if recompute and self.cpu:
            raise NotImplementedError("MegatronEngine: activation recomputation uses Megatron's CUDA RNG "
                                      "checkpointing; set actor.gradient_checkpointing: false on CPU")
        self._te = self._use_te()
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        # One model chunk per virtual stage: chunk v of stage s holds the layers Megatron assigns to (v, s);
        # the embedding lives on chunk 0 of the first stage, norm and output layer on the last chunk of the last.
        # Building a tied model's last stage all-reduces its embedding copy with the first stage.
        with self._cuda_context():
            self.chunks = [convert.gpt_model(self.hf_config, tf_config, transformer_engine=self._te,
                                             pre_process=self.first_stage and v == 0,
                                             post_process=self.last_stage and v == self.vpp - 1,
                                             vp_stage=v if self.vpp > 1 else None) for v in range(self.vpp)]
        for param in self._parameters():  # the torch norms are created float32 whatever params_dtype says;
            if param.dtype != master:  # Module.to would drop Megatron's attributes (tensor_model_parallel)
                param.data = param.data.to(master)
        self._load_hf_weights(self.source)
        if self.role == "reference":
            for chunk in self.chunks:
                chunk.requires_grad_(False)
        self.tf_config = tf_config
        self._autocast = master != self.dtype
        if self.role == "actor" and not self.cpu:
            self._wrap_gpu(cfg)
        else:
            self.model = [chunk.eval() for chunk in self.chunks]
            if self.role == "actor":
                self._build_cpu_optimizer(cfg)

    def _parameters(self) -> list[Any]:
        """Every parameter of this rank's chunks (its pipeline stage's share of the model)."""
        return [param for chunk in self.chunks for param in chunk.parameters()]

    def _require_model(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"MegatronEngine.{what}: the engine is not initialized (call initialize() first) "
                               f"or was closed")

    # ------------------------------------------------------------------ the contract
    def forward_logprobs(self, batch: dict, temperature: float = 1.0) -> dict:
        """Per-token ``logprobs`` and ``entropy`` (CPU float32 tensors of T values, 0.0 at each sequence's first
        token).

        Collective: every rank calls it with the same batch and returns the whole batch's values.
        """
        self._require_model("forward_logprobs")
        packed = Packed(batch, "MegatronEngine")
        plan = self._plan(packed.lengths)
        out = torch.zeros(2, packed.T, dtype=torch.float32)

        def keep(i: int, logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            if plan[i] and self.tp_rank == 0:
                idx = packed.token_index(plan[i])
                out[0, idx], out[1, idx] = logprobs.float().cpu(), entropy.float().cpu()
            return logprobs.new_zeros(())

        self._schedule(packed, plan, temperature, keep, forward_only=True)
        if self.world > 1:
            box = out.to(self._comm_device())
            # Each token from exactly one data-parallel rank's last stage, tp rank 0; every other rank adds 0:
            # every rank (every pipeline stage included) returns the whole batch's values.
            dist.all_reduce(box)
            out = box.cpu()
        logprobs, entropy = out.unbind(0)
        return {"logprobs": logprobs, "entropy": entropy}

    def train_batch(self, batch: dict, loss_fn: Any, temperature: float = 1.0, epochs: int = 1) -> dict:
        """One policy update on ``batch``: an optimizer step per mini-batch (``batch["minibatch"]``; the whole
        batch without it) for each of ``epochs`` passes, then the schedule's step and ``version`` + 1.
        ``loss_fn(logprobs, entropy, mb) -> (token-mean loss, stats)``.

        ``mb`` holds the micro-batch's per-token keys as tensors over its
        tokens (``loss_mask`` bool, floats float32, ints int64), per-sequence
        keys over its sequences, ``seq_lens``, ``cu_seqlens`` and
        ``token_index``, as in the fsdp engine. Returns ``loss``, ``grad_norm``
        (before clipping), ``lr``, ``n_tokens``, ``n_loss_tokens``,
        ``n_micro_batches``, ``update_skipped`` and the loss-token-weighted
        means of ``loss_fn``'s stats; over several optimizer steps each
        stat's mean over them and ``n_optimizer_steps``
        (:func:`areal_core.train_batches.merge_update_stats`).
        ``mb["update_step"]``: the steps already taken in this update.
        """
        self._require_model("train_batch")
        if self.optimizer is None:
            raise RuntimeError(f"MegatronEngine.train_batch: this engine has role {self.role!r} (a frozen copy "
                               f"with no optimizer); only an engine built with role 'actor' trains")
        lr = self._apply_lr()
        steps = [self._optimizer_step(part, loss_fn, temperature, j, lr)
                 for j, part in enumerate(update_batches(batch, epochs))]
        self.schedule.step += 1  # once per update: the schedule counts versions, not optimizer steps
        self._apply_lr()
        self._version += 1
        return merge_update_stats(steps, epochs)

    def close(self) -> None:
        self.model = None
        self.chunks = []
        self.optimizer = None
