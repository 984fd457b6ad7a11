"""The ``megatron`` train engine: HF Llama / Qwen2 as a Megatron-Core ``GPTModel``, tensor x pipeline x data parallel.

One engine per rank. The world is the launcher's ``torch.distributed`` group
(gloo on CPU, nccl on GPU; a one-process gloo group is made when there is
none, since Megatron's parallel state needs one), split by Megatron's
``parallel_state`` into tensor-parallel groups of ``t``, pipeline groups of
``p`` stages (the allocation's ``megatron:d..p..t..``) and data-parallel
groups of ``world / (t p)``. With ``actor.virtual_pipeline_size`` v > 1 each
stage holds v chunks of layers (Megatron's interleaved schedule). Context and
expert parallel are declared to the plan check but not built:
:meth:`MegatronEngine.initialize` refuses them, and ``areal check`` reports
them (``megatron.not-built``, reasons in :data:`areal_megatron.hooks.UNBUILT`).

Weights: the HF folder of ``model.path`` is read with safetensors and each
rank keeps its tensor-parallel shard of its stage's layers, found by each
layer's place in the whole model (:func:`areal_megatron.convert.stage_names`):
the embedding on the first stage, final norm and output layer on the last.
A tied embedding also lives on the last stage as its output layer (Megatron's
copy); the two copies' gradients are summed before every step, so they stay
equal (Megatron's ``finalize_model_grads`` on GPU, the engine on CPU).
Parameters are float32 for the actor (the optimizer's master copy);
``model.dtype: bfloat16`` computes under ``torch.autocast`` on GPU (on CPU
Megatron's linear layers cannot: the actor refuses it there). A reference
engine keeps its parameters in ``model.dtype``.

Batches are the trainer's packed lists. Sequences are shared among the
data-parallel ranks with balanced token counts, then packed into micro-batches
of at most ``actor.mb_max_tokens`` tokens (the count agreed over the world);
the tensor-parallel ranks of one data-parallel rank run the same
micro-batches. Each micro-batch is one row with a block-diagonal causal mask
(Megatron's local attention takes an arbitrary mask; rotary phases only
depend on the distance between tokens of one sequence, so the row's
positions need not restart); with ``transformer_engine: true`` on GPU the
row goes to Transformer Engine's attention as THD ``packed_seq_params``. Logprobs come from the vocab-parallel logits
(:mod:`areal_megatron.logprobs`).

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
all-reduced over the data-parallel group and the norm taken over tensor-parallel
shards and pipeline stages (:mod:`areal_megatron.cpu` says why); on GPU
Megatron's own ``DistributedDataParallel`` per chunk, ``finalize_model_grads``
and ``get_megatron_optimizer`` (the distributed optimizer, clipping inside). Learning rate: warmup then constant, linear or
cosine decay, as ``actor.optimizer`` says.

Checkpoints (:meth:`save`): ``model.safetensors`` + ``config.json`` (HF
names, every stage's layers, float32 master weights, loadable by
transformers), ``optimizer/`` (one file per tensor-parallel rank and stage on
CPU; Megatron's parameter state on GPU) and ``engine_state.json`` (version,
scheduler, t, p, virtual pipeline size) written last. Exports gather the
stages the same way.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from areal_core.api import TrainEngine
from areal_core.lr_schedule import lr_factor
from areal_core.train_batches import (UPDATE_STEP_KEY, as_list, combine_stats, cumsum, merge_update_stats,
                                     scalar_stats, to_tensor, update_batches)
from areal_megatron import convert
from areal_megatron.logprobs import vocab_parallel_logprobs

STATE_FILE = "engine_state.json"
STATE_FORMAT = 1
OPTIMIZER_DIR = "optimizer"
SIDE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
NOT_SIDE = {"config.json", "model.safetensors.index.json", "areal-converted.json"}


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


class MegatronEngine(TrainEngine):
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
    def _run_config(self) -> Any:
        if self.context.config is not None:
            return self.context.config
        from areal_core.config.schema import RunConfig

        return RunConfig()

    def initialize(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig

        cfg = self._run_config()
        self.tp, self.pp = self._parallel_sizes()
        self.device = self._pick_device()
        self.cpu = self.device.type == "cpu"
        self.dtype = getattr(torch, cfg.model.dtype)
        # The actor's float32 master weights come from the float32 copy where a plugin converts per dtype (the
        # demo model): an upcast bf16 copy would sit on the bf16 grid (see areal_fsdp.engine, same reason).
        self.source = self._model_path(cfg.model.path, "float32" if self.role == "actor" else cfg.model.dtype)
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

    def _pick_device(self) -> torch.device:
        wanted = getattr(self.context.placement, "device", None)
        if wanted != "cpu" and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            torch.cuda.set_device(device)
            return device
        if wanted == "gpu":
            raise RuntimeError("MegatronEngine: the allocation places the actor on gpu but torch sees no CUDA "
                               f"device (torch {torch.__version__}); place it with '@cpu' or install CUDA torch")
        return torch.device("cpu")

    def _init_parallel_state(self, cfg: Any) -> None:
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            from areal_core.launch.supervisor import free_port

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

    @staticmethod
    def _model_path(path: str, dtype: str) -> str:
        from areal_core.models import resolve_model_path

        return str(resolve_model_path(path, dtype))

    def _load_hf_weights(self, folder: str) -> None:
        """This rank's tensor-parallel shard of its pipeline stage's parameters, from the HF folder."""
        shard = convert.hf_to_megatron(read_hf_weights(folder), self.hf_config, tp=self.tp, rank=self.tp_rank)
        needed: set[str] = set()
        with torch.no_grad():
            for chunk in self.chunks:
                names = convert.stage_names(chunk, tied=self.tied)
                for name, param in chunk.named_parameters():
                    source = names[name]
                    needed.add(source)
                    if source not in shard:
                        raise ValueError(f"MegatronEngine: the weights of {folder} do not fit the Megatron model: "
                                         f"{source} (this stage's {name}) is missing")
                    if shard[source].shape != param.shape:
                        raise ValueError(f"MegatronEngine: {source} from {folder} has shape "
                                         f"{tuple(shard[source].shape)}, the model expects {tuple(param.shape)}")
                    param.copy_(shard[source].to(device=param.device, dtype=param.dtype))
        if self.pp > 1:  # every stage loads its share: together they must take every tensor
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, needed, group=self.pp_group)
            needed = set().union(*stages)
        if set(shard) - needed:
            raise ValueError(f"MegatronEngine: the weights of {folder} do not fit the Megatron model: unexpected "
                             f"{sorted(set(shard) - needed)[:5]}")

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
        decay, no_decay = [], []
        for p in self._parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)  # no decay on norms and biases
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps)
        self.grad_clip = float(o.grad_clip)
        self._build_scheduler(cfg, self.optimizer.param_groups)

    def _build_scheduler(self, cfg: Any, groups: list[dict]) -> None:
        o = cfg.actor.optimizer
        self.schedule = Schedule(lr=float(o.lr), warmup_steps=int(o.warmup_steps),
                                 total_steps=int(cfg.trainer.total_steps), kind=o.lr_schedule)
        self._groups = groups
        self._apply_lr()

    def _apply_lr(self) -> float:
        lr = self.schedule.lr_at(self.schedule.step)
        for group in self._groups:
            group["lr"] = lr
        return lr

    def _require_model(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"MegatronEngine.{what}: the engine is not initialized (call initialize() first) "
                               f"or was closed")

    # ------------------------------------------------------------------ batches
    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """This data-parallel rank's micro-batches (sequence indices; [] = a weight-0 filler), equal in count."""
        mine = balanced_split(lengths, self.dp)[self.dp_rank]
        bins = pack_under(mine, lengths, self.mb_max_tokens)
        box = torch.tensor([len(bins)], dtype=torch.long, device=self._comm_device())
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        count = max(1, int(box.item()))
        if self.vpp > 1:
            # The interleaved schedule runs micro-batches in groups of p per chunk: a multiple of p of them.
            count = -(-count // self.pp) * self.pp
        return bins + [[] for _ in range(count - len(bins))]

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

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

    def _schedule(self, packed: "Packed", plan: list[list[int]], temperature: float, on_last: Any,
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

    # ------------------------------------------------------------------ the contract
    def forward_logprobs(self, batch: dict, temperature: float = 1.0) -> dict:
        """Per-token ``logprobs`` and ``entropy`` (lists of T floats, 0.0 at each sequence's first token).

        Collective: every rank calls it with the same batch and returns the whole batch's values.
        """
        self._require_model("forward_logprobs")
        packed = Packed.of(batch)
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
        return {"logprobs": out[0].tolist(), "entropy": out[1].tolist()}

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

    def _optimizer_step(self, batch: dict, loss_fn: Any, temperature: float, update_step: int, lr: float) -> dict:
        """One optimizer step on ``batch`` (one mini-batch of an update); its stats."""
        packed = Packed.of(batch)
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

    # ------------------------------------------------------------------ weights
    def _gather_hf(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (CPU, the parameters' dtype) on every rank; collective over the tensor-parallel
        group, then over the pipeline group (each stage brings its layers, numbered in the whole model)."""
        own: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            names = convert.stage_names(chunk, tied=self.tied)
            own.update({names[name]: p.detach() for name, p in chunk.named_parameters()})
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(self.tp)]
        for name, value in own.items():
            if self.tp == 1:
                shards[0][name] = value.cpu()
                continue
            pieces = [torch.empty_like(value) for _ in range(self.tp)]
            dist.all_gather(pieces, value.contiguous(), group=self.tp_group)
            for r, piece in enumerate(pieces):
                shards[r][name] = piece.cpu()
        if self.pp > 1:
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, shards, group=self.pp_group)
            # A tied embedding comes from both ends (equal copies): the first stage's is kept.
            shards = [{name: t for stage in reversed(stages) for name, t in stage[r].items()} for r in range(self.tp)]
        return convert.megatron_to_hf(shards, self.hf_config)

    def _writer(self) -> bool:
        return self.rank == 0

    def export_to_disk(self, path: str) -> None:
        """Write the weights in ``model.dtype`` as a HF folder at ``path``, atomically. Collective."""
        from areal_core.checkpoint import atomic_dir

        self._require_model("export_to_disk")
        tensors = self._gather_hf()
        if self._writer():
            with atomic_dir(path) as folder:
                write_hf(folder, tensors, self.dtype, self.source)
        self._barrier()

    def export_tensors(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        """Full tensors in HF names and ``model.dtype``, in buckets of at most ``bucket_bytes`` (one tensor
        larger than that comes alone). Collective: every rank iterates; every rank gets the tensors, copies
        that later steps leave alone (at t1 / p1 in float32 the HF tensors can be the parameters themselves)."""
        self._require_model("export_tensors")
        if bucket_bytes < 1:
            raise ValueError(f"MegatronEngine.export_tensors: bucket_bytes must be >= 1, got {bucket_bytes}")
        bucket: list[tuple[str, Any]] = []
        size = 0
        for name, tensor in self._gather_hf().items():
            tensor = tensor.to(self.dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Model (master dtype, HF safetensors), optimizer, schedule and version into ``path``. Collective."""
        self._require_model("save")
        folder = Path(path)
        tensors = self._gather_hf()
        if self._writer():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete save
            shutil.rmtree(folder / OPTIMIZER_DIR, ignore_errors=True)
            (folder / OPTIMIZER_DIR).mkdir()
            write_hf(folder, tensors, self._parameters()[0].dtype, self.source)
        self._barrier()
        saved = with_optimizer and self.optimizer is not None
        if saved:
            self._save_optimizer(folder / OPTIMIZER_DIR)
        if self._writer():
            tmp = folder / f".{STATE_FILE}.tmp"
            tmp.write_text(json.dumps({"format": STATE_FORMAT, "version": self._version, "role": self.role,
                                       "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "optimizer": saved,
                                       "schedule_step": self.schedule.step if saved else None}, indent=2) + "\n")
            os.replace(tmp, folder / STATE_FILE)
        self._barrier()

    def _optimizer_file(self, kind: str) -> str:
        """This model-parallel rank's optimizer file: ``tp{r}.pt`` at p1 (as before pipeline parallel),
        ``pp{s}-tp{r}.pt`` with stages; ``kind`` prefixes Megatron's parameter state on GPU."""
        name = f"tp{self.tp_rank}.pt" if self.pp == 1 else f"pp{self.pp_rank}-tp{self.tp_rank}.pt"
        return f"{kind}-{name}" if kind else name

    def _save_optimizer(self, folder: Path) -> None:
        if self.cpu:
            if self.dp_rank == 0:  # data-parallel ranks hold the same state
                torch.save(self.optimizer.state_dict(), folder / self._optimizer_file(""))
        else:
            # Gathered over the data-parallel group and written by its rank 0: one file per tensor rank and stage.
            self.optimizer.save_parameter_state(str(folder / self._optimizer_file("parameter_state")))
            if self.dp_rank == 0:
                torch.save(self.optimizer.state_dict(), folder / self._optimizer_file("common"))
        self._barrier()

    def load(self, path: str, *, with_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote (any HF folder of the model, weights only, with ``with_optimizer=False``)."""
        self._require_model("load")
        folder = Path(path)
        state_file = folder / STATE_FILE
        meta = json.loads(state_file.read_text()) if state_file.is_file() else None
        self._load_hf_weights(str(folder))
        if with_optimizer and self.optimizer is not None:
            if not meta or not meta.get("optimizer"):
                raise FileNotFoundError(f"MegatronEngine.load: {folder} holds no optimizer state (saved with "
                                        f"with_optimizer=False, or not by this engine); load it with "
                                        f"with_optimizer=False to take the weights only")
            saved_at = (meta.get("tp"), meta.get("pp", 1), meta.get("vpp", 1))
            if saved_at != (self.tp, self.pp, self.vpp):
                was = "t{} p{} virtual pipeline {}".format(*saved_at)
                raise ValueError(f"MegatronEngine.load: {folder} was saved at {was}, this engine runs t{self.tp} "
                                 f"p{self.pp} virtual pipeline {self.vpp} (the optimizer state is split that way); "
                                 f"resume at {was} or load with with_optimizer=False")
            if self.cpu:
                self.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_DIR / self._optimizer_file(""),
                                                          weights_only=False))
            else:
                self.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_DIR / self._optimizer_file("common"),
                                                          weights_only=False))
                self.optimizer.load_parameter_state(
                    str(folder / OPTIMIZER_DIR / self._optimizer_file("parameter_state")))
            self.schedule.step = int(meta["schedule_step"])
            self._apply_lr()
        self._version = int(meta["version"]) if meta else 0
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        self.model = None
        self.chunks = []
        self.optimizer = None


# ---------------------------------------------------------------------- helpers
@dataclass
class Schedule:
    """Learning rate of step ``s`` (0-based): linear warmup, then constant, linear or cosine decay to the end."""

    lr: float
    warmup_steps: int
    total_steps: int
    kind: str
    step: int = 0

    def lr_at(self, s: int) -> float:
        return self.lr * lr_factor(s, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                                   schedule=self.kind)


def balanced_split(lengths: list[int], k: int) -> list[list[int]]:
    """``k`` lists of sequence indices with balanced token sums: longest first onto the lightest list."""
    loads = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = min(range(k), key=lambda j: (loads[j], j))
        parts[j].append(i)
        loads[j] += lengths[i]
    return [sorted(p) for p in parts]


def pack_under(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Sequences ``indices`` packed longest first into the fewest rows of at most ``budget`` tokens
    (a longer sequence alone); rows in order of their first sequence."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        fit = next((r for r, left in enumerate(room) if lengths[i] <= left), None)
        if fit is None:
            rows.append([i])
            room.append(budget - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return sorted(sorted(r) for r in rows)


class Packed:
    """A trainer batch as CPU tensors, with its sequence boundaries."""

    def __init__(self, tensors: dict, cu: list[int]) -> None:
        self.tensors = tensors
        self.cu = cu
        self.T = cu[-1]
        self.lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.ids = tensors["input_ids"]
        self.shortest = min(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))

    @classmethod
    def of(cls, batch: dict) -> "Packed":
        cu = [int(c) for c in as_list(batch["cu_seqlens"])]
        if len(cu) < 2:
            raise ValueError("MegatronEngine: the batch holds no sequences (cu_seqlens has fewer than 2 entries)")
        n_ids = len(as_list(batch["input_ids"]))
        if n_ids != cu[-1]:
            raise ValueError(f"MegatronEngine: the batch has {n_ids} input_ids but cu_seqlens ends at {cu[-1]}")
        return cls({k: to_tensor(k, v) for k, v in batch.items() if k != "cu_seqlens"}, cu)

    def lens(self, seqs: list[int]) -> list[int]:
        return [self.lengths[s] for s in seqs]

    def token_index(self, seqs: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(self.cu[s], self.cu[s + 1]) for s in seqs])

    def micro_batch(self, seqs: list[int]) -> dict:
        """Per-token keys over the tokens of ``seqs`` (packed in that order), per-sequence keys over ``seqs``."""
        tokens = self.token_index(seqs)
        n_seq = len(self.lengths)
        mb: dict = {}
        for key, value in self.tensors.items():
            if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == self.T:
                mb[key] = value[tokens]
            elif isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n_seq:
                mb[key] = value[torch.tensor(seqs)]
            else:
                mb[key] = value
        lens = self.lens(seqs)
        mb["seq_lens"] = torch.tensor(lens)
        mb["cu_seqlens"] = torch.tensor([0, *cumsum(lens)])
        mb["token_index"] = tokens
        return mb


def read_hf_weights(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a HF model folder (CPU)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"MegatronEngine: {folder} holds no *.safetensors weights; model.path must be a "
                                f"Hugging Face model folder (safetensors + config.json)")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    return out


def write_hf(folder: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> None:
    """HF model files into ``folder``: weights (sharded past 5 GiB), config.json saying ``dtype``, the source's
    tokenizer and generation files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    split = split_torch_state_dict_into_shards(cast, filename_pattern="model{suffix}.safetensors")
    for filename, names in split.filename_to_tensors.items():
        save_file({n: cast[n] for n in names}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in cast.values())},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config = AutoConfig.from_pretrained(source)
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(str(folder))
    for file in sorted(Path(source).iterdir()):
        if file.is_file() and file.suffix in SIDE_SUFFIXES and file.name not in NOT_SIDE \
                and not (folder / file.name).exists():
            shutil.copy2(file, folder / file.name)
