"""The ``fsdp`` train engine: any HF causal LM, sharded with FSDP2 over the data-parallel ranks.

One engine per rank. With ``torch.distributed`` initialized (gloo on CPU,
nccl on GPU) the world is a ``(dp, cp, tp)`` device mesh, ``tp`` the inner
dimension (rank = (dp_rank * cp + cp_rank) * tp + tp_rank; ``tp`` and ``cp``
are the allocation's ``t`` and ``c``, 1 by default, in any combination).
Tensor parallel first splits each decoder layer's heads and MLP columns over
the ``tp`` ranks (DTensor); then, when ``dp x cp > 1``, every decoder layer
and the root are ``fully_shard``-ed over the ``dp`` (and ``cp``) ranks (the
FSDP2 + TP recipe). Context parallel gives each cp rank a share of every
packed row (:mod:`areal_fsdp.context`). With both, each rank holds its
share of the row for its share of the heads: the column-parallel q/k/v
projections hand attention plain tensors of the local heads, whose keys and
values are all-gathered over the cp group (the ranks with the same dp and
tp rank), so the row is reassembled head by head. Without a process group
the world is this process.

Precision: parameters (the optimizer's master copy) are float32 for the
actor. ``model.dtype: bfloat16`` computes in bfloat16: through FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when sharded,
through ``torch.autocast`` when not. Logprobs and entropy are always float32.
A reference engine (frozen, no optimizer) keeps its parameters in
``model.dtype``.

Batches are the trainer's packed lists (see ``areal_core.rollout.pack_groups``).
Sequences are shared among data-parallel ranks (the c x t ranks of one
context / tensor-parallel block get the same ones) with balanced token counts, then packed into
as many micro-batches as the fullest rank needs under ``actor.mb_max_tokens``
(agreed with an all-reduce); each micro-batch is one row with a
block-diagonal causal mask (:mod:`areal_fsdp.logprobs`). A rank with fewer
sequences than micro-batches runs its spare ones on the batch's shortest
sequence with weight 0, so every rank joins every collective.

Loss normalisation: ``loss_fn`` returns the token mean over a micro-batch's
``loss_mask`` tokens; the engine weights it by (those tokens / the batch's
loss tokens), so the summed gradient is the gradient of the batch's token
mean, whatever the split into ranks and micro-batches.

Checkpoints (:meth:`save`): ``model.safetensors`` + ``config.json`` (the
float32 master weights, loadable by transformers), ``optimizer/`` (a
``torch.distributed.checkpoint`` folder of the sharded AdamW state, written by
every rank, reloadable at another world size), ``engine_state.json``
(version, scheduler) written last.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal_core.api import TrainEngine
from areal_core.lr_schedule import lr_factor
from areal_core.train_batches import (UPDATE_STEP_KEY, as_list, combine_stats, cumsum, merge_update_stats, scalar_stats,
                                     to_tensor, update_batches)
from areal_fsdp import attention, context
from areal_fsdp.hf_folder import checkpoint_names, write_hf_files, write_hf_folder, write_json_atomic
from areal_fsdp.lora import (add_lora, export_items, is_adapter, lora_layers, module_names, read_adapter,
                              write_adapter)
from areal_fsdp.logprobs import next_token_logprobs, packed_attention_mask, sequence_ids, token_logprobs
from areal_fsdp.packing import first_fit_decreasing, karmarkar_karp, micro_batches
from areal_fsdp.prefix import SharedRow, attention_plan, common_prefix, share_prefixes

ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
STATE_FILE = "engine_state.json"
STATE_FORMAT = 1
OPTIMIZER_DIR = "optimizer"
ADAPTER_DIR = "adapter"
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


class _LogprobModel(nn.Module):
    """The FSDP root: a HF causal LM whose forward returns per-token (logprobs, entropy) of a packed row.

    Wrapping keeps the output projection inside the root's forward, so FSDP
    gathers it and the logits are computed a chunk at a time from the hidden
    states (:func:`areal_fsdp.logprobs.token_logprobs`).
    """

    def __init__(self, lm: nn.Module, chunk: int) -> None:
        super().__init__()
        self.lm = lm
        self.chunk = chunk
        self.softcap = getattr(lm.config, "final_logit_softcapping", None)

    def hidden(self, input_ids, position_ids, attention_mask, scorer, attention_kwargs) -> torch.Tensor:
        """The row's last hidden states [Tc, H]; with ``scorer`` [T] (shared prefixes) the states at those rows."""
        out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                    attention_mask=attention_mask, use_cache=False, **attention_kwargs)
        hidden = out.last_hidden_state[0]
        return hidden if scorer is None else hidden[scorer]

    def forward(self, input_ids, position_ids, attention_mask, is_start, temperature: float = 1.0,
                only=None, targets=None, scorer=None, **attention_kwargs):
        """Token ``t``'s values from ``h_{t-1}``; with ``targets`` [T] (context parallel: a rank's share of a row,
        not contiguous; shared prefixes: the batch's tokens, ``scorer`` naming the row position scoring each),
        position ``p``'s values score ``targets[p]`` from ``h_p``, and ``is_start`` / ``only`` describe that
        target token."""
        hidden = self.hidden(input_ids, position_ids, attention_mask, scorer, attention_kwargs)
        head = self.lm.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        if targets is None:
            return token_logprobs(hidden, weight, bias, input_ids[0], is_start, temperature=temperature,
                                  chunk=self.chunk, softcap=self.softcap, only=only)
        wanted = ~is_start if only is None else ~is_start & only.bool()
        return next_token_logprobs(hidden, weight, bias, targets, wanted, temperature=temperature, chunk=self.chunk,
                                   softcap=self.softcap)


class _ValueModel(_LogprobModel):
    """The critic's FSDP root: the same backbone with ``lm_head`` a ``[1, H]`` value head.

    Returns ``(values [T], zeros [T])`` float32 so the engine's micro-batching,
    sharding, training and checkpointing serve it unchanged: ``values[t]`` is
    the value of the state in which token ``t`` was chosen, read from the
    hidden state of token ``t - 1`` (0.0 at each sequence's first token).
    """

    def forward(self, input_ids, position_ids, attention_mask, is_start, temperature: float = 1.0,
                only=None, targets=None, scorer=None, **attention_kwargs):
        hidden = self.hidden(input_ids, position_ids, attention_mask, scorer, attention_kwargs)
        v = self.lm.get_output_embeddings()(hidden).squeeze(-1).float()  # [T]
        if targets is not None:  # context parallel / shared prefixes: position p holds its target token's value
            return torch.where(is_start, 0.0, v), torch.zeros_like(v)
        values = torch.where(is_start, 0.0, torch.cat([v.new_zeros(1), v[:-1]]))
        return values, torch.zeros_like(values)


def _attach_value_head(lm: nn.Module, seed: int) -> None:
    """Replace the LM head by a scalar value head (untied; small random weights, the same on every rank)."""
    hidden = lm.get_input_embeddings().embedding_dim
    dtype = lm.get_input_embeddings().weight.dtype
    head = nn.Linear(hidden, 1, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)) / math.sqrt(hidden))
        head.bias.zero_()
    lm.config.tie_word_embeddings = False
    lm.set_output_embeddings(head)


class FSDPEngine(TrainEngine):
    """Train engine on PyTorch FSDP2 (``actor.backend: fsdp``). See the module docstring."""

    config_class = FSDPEngineConfig
    capabilities = frozenset({"save_load", "export_disk", "export_tensors", "export_beside_training", "reference",
                              "critic", "minibatches"})

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

    def _run_config(self) -> Any:
        if self.context.config is not None:
            return self.context.config
        from areal_core.config.schema import RunConfig

        return RunConfig()

    def initialize(self) -> None:
        if self.model is not None:
            return
        cfg = self._run_config()
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
        # A trained role keeps float32 master weights, so it asks for the float32 copy where a plugin converts
        # the model per dtype (the built-in demo model). Loading the bf16 copy and upcasting it put every master
        # weight exactly on the bf16 grid: bf16 compute (autocast, and the bf16 inference engine) then did not
        # see an update until it grew past half a bf16 step. On benchmarks/vs_trl.py (bf16, lr 1e-5, 30 steps,
        # 3 seeds) greedy accuracy went 0.39 -> 0.44 from the bf16 copy and 0.39 -> 0.56 from the float32 one.
        self.source = self._model_path(cfg.model.path, "float32" if trained else cfg.model.dtype)
        self.mb_max_tokens = int(cfg.actor.mb_max_tokens)
        lm = self._load_lm(self.source, master)
        if self.role == "actor" and cfg.actor.gradient_checkpointing:
            if not getattr(lm, "supports_gradient_checkpointing", False):
                raise ValueError(f"FSDPEngine: {type(lm).__name__} does not support gradient checkpointing; "
                                 f"set actor.gradient_checkpointing: false")
            if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
                lm.activation_checkpointing_enable({"use_reentrant": False})
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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

    def _pick_device(self) -> torch.device:
        wanted = getattr(self.context.placement, "device", None)
        if wanted != "cpu" and torch.cuda.is_available():
            if dist.is_initialized() and dist.get_world_size() > 1 and "nccl" not in str(dist.get_backend()):
                # FSDP's collectives on CUDA tensors through a gloo-only group crashed the ranks (SIGSEGV).
                raise RuntimeError(f"FSDPEngine: torch.distributed was initialised with backend "
                                   f"{dist.get_backend()!r}, which cannot reduce CUDA tensors, and this rank would "
                                   f"train on cuda; initialise it with 'cpu:gloo,cuda:nccl' (as areal's trainer does) "
                                   f"or place the actor with '@cpu'")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            torch.cuda.set_device(device)
            return device
        if wanted == "gpu":
            raise RuntimeError("FSDPEngine: the allocation places the actor on gpu but torch sees no CUDA device "
                               f"(torch {torch.__version__}); place it with '@cpu' or install a CUDA build of torch")
        return torch.device("cpu")

    @staticmethod
    def _model_path(path: str, dtype: str) -> str:
        from areal_core.models import resolve_model_path

        return str(resolve_model_path(path, dtype))

    def _load_lm(self, path: str, dtype: torch.dtype) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if not Path(path).is_dir():
            raise FileNotFoundError(f"FSDPEngine: model.path {path!r} is not a folder; it must be a Hugging Face "
                                    f"model folder (safetensors + config.json)")
        try:
            lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                      attn_implementation=self.options.attn_implementation)
        except (OSError, ValueError, ImportError) as exc:
            raise RuntimeError(f"FSDPEngine: cannot load a causal LM from {path} with attention "
                               f"{self.options.attn_implementation!r}: {exc}") from exc
        lm.config.use_cache = False
        _no_dropout(lm)
        if self.cp > 1:
            if not attention.supports(lm.config):
                raise NotImplementedError(f"FSDPEngine: context parallel (c{self.cp}) attends with a causal "
                                          f"same-sequence mask only; {type(lm).__name__} has sliding-window layers "
                                          f"or attention-logit soft-capping. Use d instead of c")
            context.register()  # local queries against all-gathered keys (see areal_fsdp.context)
            lm.set_attn_implementation(context.CP_SDPA)
        elif self.options.attn_implementation == "sdpa" and attention.supports(lm.config):
            attention.register()  # the same kernel, one packed sequence at a time (see areal_fsdp.attention)
            lm.set_attn_implementation(attention.PACKED_SDPA)
        return lm

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

    def _build_optimizer(self, cfg: Any) -> None:
        o = cfg.actor.optimizer
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)  # no decay on norms and biases
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # The fused kernel on plain (unsharded) tensors: 133M float32 parameters took 0.24 s a step against
        # 1.1 s for the default foreach kernel on one CPU core. Sharded (DTensor) parameters keep the default.
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps, fused=self.world == 1 or None)
        self.grad_clip = float(o.grad_clip)
        factor = partial(lr_factor, warmup_steps=o.warmup_steps, total_steps=cfg.trainer.total_steps,
                         schedule=o.lr_schedule)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

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
        mine = karmarkar_karp(costs, self.dp)[self.dp_rank] if self.dp > 1 else list(range(len(units)))
        own = [costs[i] for i in mine]
        count = len(first_fit_decreasing(own, self.mb_max_tokens))
        if self.world > 1:
            box = torch.tensor([count], dtype=torch.long, device=self._comm_device())
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            count = int(box.item())
        count = max(count, 1)
        bins = micro_batches(own, self.mb_max_tokens, count) if own else [[] for _ in range(count)]
        return [sorted(s for j in b for s in units[mine[j]]) for b in bins]

    @property
    def _shares_prefixes(self) -> bool:
        """Whether micro-batches run as prefix trees: the option on, the per-sequence sdpa path (whose plan
        carries the tree), no context parallel (its rows are split by position, not by sequence)."""
        return (self.options.share_prefixes and self.cp == 1
                and self.lm.config._attn_implementation == attention.PACKED_SDPA)

    def _units(self, batch: dict, lengths: list[int]) -> tuple[list[list[int]], list[int]]:
        """What the planner places whole: each sequence alone, or with shared prefixes on, the samples of one
        group (``group_index``) together, so their prompt is shared; costed as the tokens the model runs (the
        group's common prefix once) and cut into pieces within the micro-batch budget."""
        if not (self._shares_prefixes and "group_index" in batch):
            return [[i] for i in range(len(lengths))], lengths
        ids = to_tensor("input_ids", batch["input_ids"])
        starts = list(cumsum([0] + lengths))
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(as_list(batch["group_index"])):
            groups.setdefault(int(g), []).append(i)
        units: list[list[int]] = []
        costs: list[int] = []
        for members in groups.values():
            first = ids[starts[members[0]]:starts[members[0] + 1]]
            unit: list[int] = []
            cost = 0
            for m in members:
                common = 0 if not unit else common_prefix(first[None], ids[starts[m]:starts[m + 1]][None])
                extra = lengths[m] - common
                if unit and cost + extra > self.mb_max_tokens:
                    units.append(unit)
                    costs.append(cost)
                    unit, cost, extra = [], 0, lengths[m]
                unit.append(m)
                cost += extra
            units.append(unit)
            costs.append(cost)
        return units, costs

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _tensors(self, batch: dict) -> tuple[dict, list[int], int]:
        """The batch as tensors (CPU), sequence offsets and the token count T."""
        cu = [int(c) for c in as_list(batch["cu_seqlens"])]
        T = cu[-1]
        n_ids = len(as_list(batch["input_ids"]))
        if n_ids != T:
            raise ValueError(f"FSDPEngine: the batch has {n_ids} input_ids but cu_seqlens ends at {T}")
        return {k: to_tensor(k, v) for k, v in batch.items() if k != "cu_seqlens"}, cu, T

    def _micro_batch(self, tensors: dict, cu: list[int], T: int, seqs: list[int]) -> dict:
        """The per-token and per-sequence tensors of sequences ``seqs``, packed in that order."""
        n_seq = len(cu) - 1
        token_idx = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in seqs])
        seq_idx = torch.tensor(seqs, dtype=torch.long)
        mb: dict = {}
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == T:
                mb[key] = value[token_idx]
            elif isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n_seq:
                mb[key] = value[seq_idx]
            else:
                mb[key] = value
        lens = [cu[s + 1] - cu[s] for s in seqs]
        mb["seq_lens"] = torch.tensor(lens, dtype=torch.long)
        mb["cu_seqlens"] = torch.tensor([0] + list(cumsum(lens)), dtype=torch.long)
        mb["token_index"] = token_idx
        if "position_ids" not in mb:
            mb["position_ids"] = torch.cat([torch.arange(n) for n in lens])
        return mb

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
        """Per-token ``logprobs`` and ``entropy`` (lists of T floats, 0.0 at each sequence's first token).

        Collective when the world is larger than 1: every rank computes its
        share and every rank returns the whole batch's values.
        """
        self._require_model("forward_logprobs")
        tensors, cu, T = self._tensors(batch)
        plan = self._plan(batch)
        filler = _shortest(cu)
        logprobs = torch.zeros(T, dtype=torch.float32)
        entropy = torch.zeros(T, dtype=torch.float32)
        with torch.no_grad():
            for seqs in plan:
                mb = self._micro_batch(tensors, cu, T, seqs or [filler])
                lp, ent = self._forward(mb, temperature)
                if seqs:
                    logprobs[mb["token_index"]] = lp.float().cpu()
                    entropy[mb["token_index"]] = ent.float().cpu()
        if self.dp > 1:
            both = torch.stack([logprobs, entropy]).to(self._comm_device())
            dist.all_reduce(both, group=self._dp_group())  # one dp rank computes each token; the others add 0
            logprobs, entropy = both.cpu()
        return {"logprobs": logprobs.tolist(), "entropy": entropy.tolist()}

    def forward_values(self, batch: dict) -> dict:
        """Critic: per-token ``values`` (list of T floats; ``values[t]`` read from token ``t - 1``, 0.0 at starts)."""
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
        tensors, cu, T = self._tensors(batch)
        plan = self._plan(batch)
        mask = tensors.get("loss_mask")
        total_loss_tokens = int(mask.sum()) if mask is not None else T
        filler = _shortest(cu)
        records: list[tuple[int, float, dict]] = []
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over from a step that raised
        self.model.train()
        try:
            for seqs in plan:
                mb = self._micro_batch(tensors, cu, T, seqs or [filler])
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
        # GradScaler sets) as it reads it, so clipping there costs no pass of its own over the gradients:
        # clip_grad_norm_'s multiply was ~47 ms of a 1.4 s bf16 step of SmolLM2-135M on one core. The groups'
        # own flag decides, as it does for step(): a loaded checkpoint of a sharded run keeps the default kernel.
        if all(group.get("fused") for group in self.optimizer.param_groups):
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False))
            coef = max_norm / (norm + 1e-6)  # clip_grad_norm_'s coefficient
            self.optimizer.grad_scale = torch.tensor(1.0 / coef, device=self.device) if coef < 1.0 else None
            return norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

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

    # ------------------------------------------------------------------ weights
    def _items(self, which: str = "merged") -> tuple[dict, list[tuple[str, list[str], Any]]]:
        """The (sharded) state dict and what to export from it: ``merged`` (LoRA merged in), ``base``
        (LoRA's frozen weights, plain names) or ``adapters`` (LoRA names); tied aliases left out."""
        state = {name: value for name, value in self.lm.state_dict().items() if name not in self._aliases}
        if which == "adapters":
            return state, [(name, [name], None) for name in state if is_adapter(name)]
        return state, export_items(list(state), self._lora_layers, merged=which == "merged")

    def _full_state_dict(self, which: str = "merged") -> dict[str, torch.Tensor]:
        """Full tensors (master dtype, CPU) of :meth:`_items` ``which``, exported names.

        Collective when sharded; only rank 0 gets the tensors, the others an empty dict.
        """
        state, items = self._items(which)
        return {name: t for bucket in self._stream_buckets(state, items, [list(range(len(items)))], None)
                for name, t in bucket}

    def _load_full_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Copy full tensors (module names) into the (sharded) parameters and buffers."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        own = self.lm.state_dict(keep_vars=True)
        missing = [n for n in own if n not in state and self._aliases.get(n) not in state]
        unexpected = [n for n in state if n not in own]
        if missing or unexpected:
            raise ValueError(f"FSDPEngine: the weights in {where} do not fit {type(self.lm).__name__}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, target in own.items():
                if name in self._aliases:
                    continue  # the same tensor as its primary
                src = state[name]
                if isinstance(target, DTensor):
                    src = src.to(device=target.device, dtype=target.dtype)
                    target.copy_(distribute_tensor(src, target.device_mesh, target.placements, src_data_rank=None))
                else:
                    target.copy_(src.to(device=target.device, dtype=target.dtype))

    def export_to_disk(self, path: str) -> None:
        """Write the weights in ``model.dtype`` as a HF folder at ``path``, atomically.

        With LoRA, the adapters merged in; or, with ``lora_export: adapter``,
        the adapters only, as a PEFT adapter folder. Collective when the world
        is larger than 1 (every rank gathers, rank 0 writes).
        """
        self._require_model("export_to_disk")
        if self._peft is not None and self.options.lora_export == "adapter":
            from areal_core.checkpoint import atomic_dir

            adapters = self._full_state_dict("adapters")
            if self.rank == 0:
                with atomic_dir(path) as folder:
                    write_adapter(folder, adapters, self._peft, self.dtype, self.source)
            self._barrier()
            return
        state = self._full_state_dict()
        if self.rank == 0:
            write_hf_folder(path, self.lm, state, self.dtype, source=self.source)
        self._barrier()

    def export_tensors(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights as full CPU tensors in HF names and ``model.dtype``, in buckets of at most ``bucket_bytes``.

        Collective: every rank iterates the whole generator (the same number of
        buckets everywhere); rank 0's buckets hold ``(name, tensor)`` pairs, the
        other ranks' are empty lists. A tensor larger than ``bucket_bytes`` is a
        bucket on its own. On an accelerator the next bucket's all-gathers are
        issued (DTensor ``redistribute(async_op=True)``) before the current
        bucket is handed out, so gathering overlaps with whatever the caller
        does with it; over gloo they are waited one by one (see ``_gather``).
        Tied aliases (a tied ``lm_head.weight``) are left out, as on disk;
        LoRA adapters are merged in (the names are the plain model's). The
        tensors are copies (``_finish``), never views of the parameters.
        """
        self._require_model("export_tensors")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"FSDPEngine.export_tensors: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        state, items = self._items("merged")
        if not self._export_lock.acquire(timeout=EXPORT_WAIT_S):
            raise TimeoutError(f"FSDPEngine.export_tensors: waited {EXPORT_WAIT_S:.0f} s for the previous export's "
                               f"buckets to be read to the end (or the export closed)")
        try:
            buckets = self._stream_buckets(state, items, _buckets(state, items, self.dtype, bucket_bytes), self.dtype)
        except BaseException:
            self._export_lock.release()
            raise
        return _Leased(buckets, self._export_lock)

    @contextmanager
    def _weights_unread(self) -> Iterator[None]:
        """Hold off writing the weights while an export (maybe on another thread) has not read them all."""
        if not self._export_lock.acquire(timeout=EXPORT_WAIT_S):
            raise TimeoutError(f"FSDPEngine.train_batch: waited {EXPORT_WAIT_S:.0f} s before the optimizer step for "
                               f"an export_tensors() whose buckets were neither all read nor closed")
        try:
            yield
        finally:
            self._export_lock.release()

    def _stream_buckets(self, state: dict, items: list, plan: list[list[int]],
                        dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket of ``plan`` (indices into ``items``), its successor's gathers in flight while it is used."""
        pending = self._gather(state, [items[i] for i in plan[0]]) if plan else []
        for k in range(len(plan)):
            current = pending
            pending = self._gather(state, [items[i] for i in plan[k + 1]]) if k + 1 < len(plan) else []
            yield self._finish(current, dtype)

    @staticmethod
    def _gather(state: dict, items: list) -> list:
        """Start the all-gathers of the items' sources (sharded DTensors); :meth:`_finish` waits for them."""
        from torch.distributed.tensor import DTensor, Replicate

        out = []
        for name, sources, combine in items:
            values = []
            for source in sources:
                value = state[source].detach()
                if isinstance(value, DTensor):
                    # In flight only on an accelerator (nccl). Over gloo, DTensor's async all-gathers (functional
                    # collectives) corrupt the heap: two CPU ranks exporting 30 times in a row died every time
                    # (SIGSEGV, "malloc(): unaligned tcache chunk detected", torch 2.13), never when waited one
                    # by one. On a CPU the gather and the caller's work share the same cores anyway.
                    value = value.redistribute(placements=[Replicate()] * value.device_mesh.ndim,
                                               async_op=value.device.type != "cpu").to_local()
                values.append(value)
            out.append((name, values, combine))
        return out

    def _finish(self, gathered: list, dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
        """Wait for a bucket's gathers; on rank 0 its tensors in HF names, combined, cast and copied to CPU."""
        if self.rank != 0:
            for _, values, _ in gathered:
                for value in values:
                    if hasattr(value, "wait"):
                        value.wait()
            return []
        tensors = {}
        for name, values, combine in gathered:
            value = combine(values) if combine is not None else values[0]
            fresh = combine is not None  # a combined tensor is already new
            if dtype is not None and value.is_floating_point() and value.dtype != dtype:
                value, fresh = value.to(dtype), True
            # One pass per tensor: a cast on the CPU already made the copy the contract asks for
            tensors[name] = value if fresh and value.device.type == "cpu" else value.to("cpu", copy=True)
        if dtype is None:
            return list(tensors.items())  # module names: the HF-folder writer renames
        return list(checkpoint_names(self.lm, tensors).items())

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        """Model (master dtype, HF safetensors), optimizer (DCP, sharded), scheduler and version into ``path``.

        With LoRA the model files hold the frozen base weights and ``adapter/``
        the adapters (PEFT format, master dtype). Every rank calls it with the
        same folder.
        """
        self._require_model("save")
        folder = Path(path)
        state = self._full_state_dict("base")
        adapters = self._full_state_dict("adapters") if self._peft is not None else {}
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / STATE_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete save
            shutil.rmtree(folder / OPTIMIZER_DIR, ignore_errors=True)  # no shard files of an older save remain
            master = next(self.lm.parameters()).dtype
            write_hf_files(folder, self.lm, state, master, source=self.source)
            if self._peft is not None:
                (folder / ADAPTER_DIR).mkdir(exist_ok=True)
                write_adapter(folder / ADAPTER_DIR, adapters, self._peft, master, self.source)
        self._barrier()
        saved_optimizer = with_optimizer and self.optimizer is not None
        if saved_optimizer:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optim = get_optimizer_state_dict(self.model, self.optimizer)
            with _quiet_single_process_dcp():
                dcp.save({"optimizer": optim}, storage_writer=dcp.FileSystemWriter(str(folder / OPTIMIZER_DIR),
                                                                                   overwrite=True),
                         no_dist=self.world == 1)
        if self.rank == 0:
            write_json_atomic(folder / STATE_FILE, {
                "format": STATE_FORMAT, "version": self._version, "role": self.role, "world_size": self.world,
                "optimizer": saved_optimizer, "lora": self._peft is not None,
                "scheduler": self.scheduler.state_dict() if saved_optimizer else None,
            })
        self._barrier()

    def load(self, path: str, *, with_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote; every rank calls it with the same folder.

        With ``with_optimizer=False`` any HF model folder of the same
        architecture loads (weights only; the version is the folder's, else 0);
        with LoRA the folder needs ``adapter/`` too.
        """
        import json

        from transformers import AutoModelForCausalLM

        self._require_model("load")
        folder = Path(path)
        state_file = folder / STATE_FILE
        meta = json.loads(state_file.read_text()) if state_file.is_file() else None
        master = next(self.lm.parameters()).dtype
        if self.role == "critic":  # a value head transformers would not load into a causal LM: the files as written
            from safetensors.torch import load_file

            state = {}
            for file in sorted(folder.glob("*.safetensors")):
                state.update({name: t.to(master) for name, t in load_file(str(file)).items()})
        else:
            fresh = AutoModelForCausalLM.from_pretrained(str(folder), dtype=master)
            state = dict(fresh.state_dict())
            del fresh
        if self._peft is not None:
            own = list(self.lm.state_dict())
            state = {**module_names(state, own), **read_adapter(folder / ADAPTER_DIR)}
        self._load_full_state_dict(state, str(folder))
        if with_optimizer and self.optimizer is not None:
            if not meta or not meta.get("optimizer"):
                raise FileNotFoundError(f"FSDPEngine.load: {folder} holds no optimizer state (saved with "
                                        f"with_optimizer=False, or not by this engine); load it with "
                                        f"with_optimizer=False to take the weights only")
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            box = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            with _quiet_single_process_dcp():
                dcp.load(box, checkpoint_id=str(folder / OPTIMIZER_DIR), no_dist=self.world == 1)
            set_optimizer_state_dict(self.model, self.optimizer, box["optimizer"])
            self.scheduler.load_state_dict(meta["scheduler"])
        self._version = int(meta["version"]) if meta else 0
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        self.model = None
        self.optimizer = None
        self.scheduler = None


# ---------------------------------------------------------------------- helpers
@contextmanager
def _quiet_single_process_dcp() -> Iterator[None]:
    """DCP warns that it runs in one process when no process group exists: that is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class _Leased:
    """An export's buckets, holding the engine's export lock until the last is read or the export is closed.

    The lock is taken when ``export_tensors`` is called, not when iteration starts, so an optimizer step on the
    calling thread cannot slip in before a consumer thread has begun. An export dropped unread releases it
    when collected.
    """

    def __init__(self, buckets: Iterator[list[tuple[str, torch.Tensor]]], lock: threading.Lock) -> None:
        self._buckets = buckets
        self._release = weakref.finalize(self, lock.release)  # runs at most once: close() or collection

    def __iter__(self) -> "_Leased":
        return self

    def __next__(self) -> list[tuple[str, torch.Tensor]]:
        try:
            return next(self._buckets)
        except BaseException:  # StopIteration at the end, or a failed gather: the weights are free again
            self.close()
            raise

    def close(self) -> None:
        self._buckets.close()
        self._release()


def _tied_aliases(lm: nn.Module) -> dict[str, str]:
    """{alias: primary} for parameters reachable under several names (tied embeddings).

    The primary is the input embedding's name when it is one of them (what
    ``save_pretrained`` keeps), else the first name.
    """
    by_id: dict[int, list[str]] = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    embed = lm.get_input_embeddings()
    embed_names = {n for n, p in lm.named_parameters(remove_duplicate=False) if p is embed.weight}
    aliases: dict[str, str] = {}
    for names in by_id.values():
        if len(names) > 1:
            primary = next((n for n in names if n in embed_names), names[0])
            aliases.update({n: primary for n in names if n != primary})
    return aliases


def _buckets(state: dict, items: list, dtype: torch.dtype, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``items`` in order, grouped so each group's bytes (floats in ``dtype``) stay within
    ``bucket_bytes``; an item larger than that is a group alone."""
    out: list[list[int]] = []
    size = 0
    for i, (_, sources, _) in enumerate(items):
        value = state[sources[0]]  # the exported tensor has the shape of its first source
        itemsize = torch.empty((), dtype=dtype).element_size() if value.is_floating_point() else value.element_size()
        nbytes = value.numel() * itemsize  # the full tensor's, also for a shard
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _no_dropout(lm: nn.Module) -> None:
    """Dropout off everywhere: forward_logprobs and train_batch must see the same function."""
    for module in lm.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0





def _shortest(cu: list[int]) -> int:
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return min(range(len(lens)), key=lambda i: (lens[i], i))
