"""HF Llama / Qwen2 <-> Megatron-Core ``GPTModel``: the config, and the weights with tensor-parallel sharding.

Config (:func:`transformer_config`): grouped-query attention
(``num_query_groups`` = HF ``num_key_value_heads``), RMSNorm, SwiGLU
(``gated_linear_unit`` + SiLU), no linear biases except Qwen2's q/k/v bias
(``add_qkv_bias``), rotary base from ``rope_parameters`` / ``rope_theta``,
tied embeddings (``share_embeddings_and_output_weights``), dropout 0.

Weights, per decoder layer (``h`` hidden, ``d`` head dim, ``n`` heads, ``g``
query groups = KV heads, ``t`` tensor-parallel size, rank ``r``):

- ``linear_qkv`` [(n/g + 2) * d * g / t, h]: column-parallel over query
  groups; each group holds its n/g query heads, then its key head, then its
  value head (HF q_proj / k_proj / v_proj, interleaved by group). Qwen2's
  biases follow the same layout.
- ``linear_proj`` [h, n * d / t]: row-parallel (HF o_proj split along its input).
- ``linear_fc1`` [2 * f / t, h]: rank r holds ``cat(gate_r, up_r)`` (HF
  gate_proj and up_proj each split in t along the output).
- ``linear_fc2`` [h, f / t]: row-parallel (HF down_proj).
- norms: replicated on every rank.
- ``embedding.word_embeddings`` / ``output_layer`` [V' / t, h]: vocab-parallel,
  the vocabulary padded to V' (a multiple of t) with zero rows that
  :mod:`areal_megatron.logprobs` masks out.

Names are the local spec's (``input_layernorm``, ``pre_mlp_layernorm``);
Transformer Engine's spec fuses those norms into ``linear_qkv`` /
``linear_fc1`` (``layer_norm_weight``) and :func:`model_names` translates.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# Local spec name -> Transformer Engine spec name (norms fused into the following linear).
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _hf(cfg: Any, key: str, default: Any = None) -> Any:
    return getattr(cfg, key, default)


def rope_base(cfg: Any) -> float:
    """The rotary base of a HF config (transformers 5 ``rope_parameters`` or 4.x ``rope_theta``); refuses scaling."""
    params = _hf(cfg, "rope_parameters") or {}
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    scaling = _hf(cfg, "rope_scaling")
    if kind != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise NotImplementedError(
            f"areal-plugin-megatron: the model's rotary embedding is {kind!r} (rope scaling); only plain RoPE "
            f"(rope_type 'default') is converted. Use the fsdp backend (actor.backend: fsdp) for this model")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else _hf(cfg, "rope_theta", 10000.0))


def check_architecture(cfg: Any) -> str:
    """'llama' or 'qwen2'; a clear error for anything else."""
    archs = list(_hf(cfg, "architectures") or [])
    arch = archs[0] if archs else f"model_type {_hf(cfg, 'model_type')!r}"
    if arch not in ARCHITECTURES:
        raise NotImplementedError(
            f"areal-plugin-megatron: model.path holds a {arch}; the megatron backend converts "
            f"{', '.join(ARCHITECTURES)} only. Use actor.backend: fsdp for other architectures")
    if _hf(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"areal-plugin-megatron: hidden_act {cfg.hidden_act!r} is not silu (SwiGLU)")
    if arch == "LlamaForCausalLM" and (_hf(cfg, "attention_bias") or _hf(cfg, "mlp_bias")):
        raise NotImplementedError("areal-plugin-megatron: Llama with attention_bias / mlp_bias is not converted")
    if arch == "Qwen2ForCausalLM" and _hf(cfg, "use_sliding_window"):
        raise NotImplementedError("areal-plugin-megatron: Qwen2 with use_sliding_window is not converted; "
                                  "use actor.backend: fsdp")
    return "qwen2" if arch == "Qwen2ForCausalLM" else "llama"


def head_dim(cfg: Any) -> int:
    return int(_hf(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size."""
    return -(-vocab // tp) * tp


def transformer_config(cfg: Any, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                       params_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None,
                       cpu: bool = True, recompute: bool = False) -> Any:
    """A Megatron ``TransformerConfig`` equal to the HF config ``cfg`` (Llama / Qwen2), split over ``tp``
    tensor-parallel ranks and ``pp`` pipeline stages of ``vpp`` chunks each.

    ``calculate_per_token_loss`` is on: the engine's micro-batch losses are already weighted by their share
    of the batch's loss tokens, so Megatron's schedule must not divide them by the number of micro-batches,
    nor its DistributedDataParallel average gradients over data-parallel ranks (it sums them).

    Between pipeline stages activations travel in ``params_dtype``. Without virtual stages each one's shape
    is sent first (``variable_seq_lengths``): the engine's packed rows differ in length, and padding every
    row to the longest would spend compute on padding. With virtual stages (``vpp`` > 1) the engine pads
    a batch's rows to one length instead: Megatron's shape exchange posts its sends to the previous and
    next stage in one order and its receives in the other, which pairs them wrongly when both neighbours
    are one rank (p2). On CPU (gloo) each send and receive is its own isend / irecv (``batch_p2p_comm``
    off)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    arch = check_architecture(cfg)
    compute = compute_dtype or params_dtype
    kwargs = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=_hf(cfg, "num_key_value_heads") or cfg.num_attention_heads, kv_channels=head_dim(cfg),
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch == "qwen2",
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        params_dtype=params_dtype, bf16=compute == torch.bfloat16, fp16=compute == torch.float16,
        # Weights come from the HF folder: no random init (and none needing a CUDA RNG).
        perform_initialization=False, use_cpu_initialization=cpu,
        # Only fusions with a pure-PyTorch path on CPU. The fused masked softmax needs a compiled kernel that the
        # megatron-core wheel does not ship, and the packed rows' block-diagonal mask is not one it handles.
        bias_activation_fusion=not cpu, masked_softmax_fusion=False, persist_layer_norm=not cpu,
        bias_dropout_fusion=not cpu, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=params_dtype if pp > 1 else None, variable_seq_lengths=pp > 1 and vpp == 1,
        batch_p2p_comm=not cpu,
        # Dense models have no experts to dispatch, but the config refuses variable lengths with the default
        # (allgather) dispatcher whatever the model.
        moe_token_dispatcher_type="alltoall",
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kwargs)


def layer_spec(cfg: Any, *, transformer_engine: bool) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if transformer_engine:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def gpt_model(cfg: Any, tf_config: Any, *, transformer_engine: bool = False, pre_process: bool = True,
              post_process: bool = True, vp_stage: int | None = None) -> Any:
    """A Megatron ``GPTModel`` (uninitialised weights, shards marked) of the HF config ``cfg`` for this rank:
    its pipeline stage's layers (chunk ``vp_stage`` of them under virtual pipeline), the embedding where
    ``pre_process``, the final norm and output layer where ``post_process``."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        tf_config, layer_spec(cfg, transformer_engine=transformer_engine),
        vocab_size=padded_vocab(cfg.vocab_size, tf_config.tensor_model_parallel_size),
        max_sequence_length=int(_hf(cfg, "max_position_embeddings", 4096)), position_embedding_type="rope",
        rotary_base=int(rope_base(cfg)) if float(rope_base(cfg)).is_integer() else rope_base(cfg),
        share_embeddings_and_output_weights=bool(_hf(cfg, "tie_word_embeddings", False)),
        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
    )
    mark_tensor_parallel_shards(model)
    return model


def mark_tensor_parallel_shards(model: Any) -> int:
    """Set Megatron's ``tensor_model_parallel`` / ``partition_dim`` on the sharded parameters of ``model``
    where they are unset; returns how many were marked.

    The parallel layers mark their weights inside their random-init routines, which
    ``perform_initialization=False`` skips (the weights come from the HF folder); without the marks a
    gradient norm would count a shard as a replicated tensor."""
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


def model_names(canonical: dict[str, Any], model_param_names: set[str]) -> dict[str, Any]:
    """``canonical`` (local-spec names) renamed to what the model's parameters are called (TE spec or local)."""
    out: dict[str, Any] = {}
    for name, value in canonical.items():
        if name not in model_param_names:
            for local, te in TE_NAMES.items():
                if name.endswith(local) and name.replace(local, te) in model_param_names:
                    name = name.replace(local, te)
        out[name] = value
    return out


def canonical_names(state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`model_names`."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        for local, te in TE_NAMES.items():
            if name.endswith(te):
                name = name.replace(te, local)
        out[name] = value
    return out


def stage_names(model: Any, *, tied: bool) -> dict[str, str]:
    """Each parameter of one pipeline chunk ``model`` -> its name in the whole model (:func:`hf_to_megatron`'s
    names: local spec, global layer numbers). Under pipeline parallel the last stage of a model with tied
    embeddings keeps a copy of the embedding as its ``output_layer.weight``: it is named as the embedding.

    A chunk numbers its layers from 0; each layer's ``layer_number`` (1-based) is its place in the whole
    model, which Megatron derives from the stage, the chunk and the layer counts."""
    numbers = {str(j): layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}
    out: dict[str, str] = {}
    for name, _ in model.named_parameters():
        (canonical,) = canonical_names({name: None})
        if canonical.startswith("decoder.layers."):
            local, rest = canonical.removeprefix("decoder.layers.").split(".", 1)
            canonical = f"decoder.layers.{numbers[local]}.{rest}"
        if tied and canonical == "output_layer.weight":
            canonical = "embedding.word_embeddings.weight"
        out[name] = canonical
    return out


def _vocab_shard(w: torch.Tensor, padded: int, tp: int, rank: int) -> torch.Tensor:
    if padded > w.shape[0]:
        w = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
    return w.chunk(tp)[rank]


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, tp: int, rank: int) -> torch.Tensor:
    """Fused per-group [q heads, k, v] rows of this rank's query groups (weights [rows, h] or biases [rows])."""
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                      dim=1)
    return fused.chunk(tp)[rank].reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: Any, *, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank``'s shard of the HF weights ``hf``, in (local-spec) Megatron names."""
    check_architecture(cfg)
    groups = _hf(cfg, "num_key_value_heads") or cfg.num_attention_heads
    if groups % tp:
        raise ValueError(f"areal-plugin-megatron: tensor parallel size {tp} does not divide the model's "
                         f"{groups} key-value heads")
    padded = padded_vocab(cfg.vocab_size, tp)
    out = {"embedding.word_embeddings.weight": _vocab_shard(hf["model.embed_tokens.weight"], padded, tp, rank),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not _hf(cfg, "tie_word_embeddings", False):
        out["output_layer.weight"] = _vocab_shard(hf["lm_head.weight"], padded, tp, rank)
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in hf:
                out[dst + f"self_attention.linear_qkv.{kind}"] = _qkv(
                    hf[attn + f"q_proj.{kind}"], hf[attn + f"k_proj.{kind}"], hf[attn + f"v_proj.{kind}"],
                    groups, tp, rank)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"].chunk(tp, dim=1)[rank]
        mlp = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"].chunk(tp)[rank],
                                                        hf[mlp + "up_proj.weight"].chunk(tp)[rank]])
        out[dst + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"].chunk(tp, dim=1)[rank]
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], cfg: Any) -> dict[str, torch.Tensor]:
    """Full HF weights from every tensor-parallel rank's shard (rank order), tied ``lm_head`` left out."""
    check_architecture(cfg)
    shards = [canonical_names(s) for s in shards]
    tp = len(shards)
    groups = _hf(cfg, "num_key_value_heads") or cfg.num_attention_heads
    heads, d = cfg.num_attention_heads, head_dim(cfg)

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    first = shards[0]
    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight")[:cfg.vocab_size],
           "model.norm.weight": first["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in first:
        out["lm_head.weight"] = cat("output_layer.weight")[:cfg.vocab_size]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = first[src + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias"):
            name = src + f"self_attention.linear_qkv.{kind}"
            if name not in first:
                continue
            fused = cat(name)
            rest = fused.shape[1:]
            per_group = fused.reshape(groups, (heads // groups + 2) * d, *rest)
            q, k, v = per_group.split([heads // groups * d, d, d], dim=1)
            out[attn + f"q_proj.{kind}"] = q.reshape(-1, *rest)
            out[attn + f"k_proj.{kind}"] = k.reshape(-1, *rest)
            out[attn + f"v_proj.{kind}"] = v.reshape(-1, *rest)
        out[attn + "o_proj.weight"] = cat(src + "self_attention.linear_proj.weight", dim=1)
        halves = [s[src + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[dst + "mlp.down_proj.weight"] = cat(src + "mlp.linear_fc2.weight", dim=1)
    return {k: v.contiguous() for k, v in out.items()}
