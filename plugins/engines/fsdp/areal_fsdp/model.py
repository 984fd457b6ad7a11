"""The model the fsdp engine trains: a HF causal LM loaded from a folder and wrapped as the FSDP root.

- :class:`_LogprobModel`: the actor's and the reference's root, returning per-token (logprobs, entropy).
- :class:`_ValueModel` and :func:`_attach_value_head`: the critic's root, the LM head replaced by a value head.
- :func:`load_lm`: the HF model with the engine's attention (packed sdpa, or context parallel's), dropout off
  (:func:`_no_dropout`); :func:`checkpoint_activations`: activation checkpointing.
- :func:`_tied_aliases`: parameter names that alias another (tied embeddings), left out of what is exported.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from areal_fsdp import attention, context
from areal_fsdp.logprobs import next_token_logprobs, token_logprobs


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


def load_lm(path: str, dtype: torch.dtype, attn_implementation: str, cp: int) -> nn.Module:
    """The HF causal LM of the folder ``path`` in ``dtype``, KV cache and dropout off, attending through the
    packed sdpa of :mod:`areal_fsdp.attention` (when it supports the model) or, with context parallel
    (``cp`` > 1), :mod:`areal_fsdp.context`'s."""
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"FSDPEngine: model.path {path!r} is not a folder; it must be a Hugging Face "
                                f"model folder (safetensors + config.json)")
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, ImportError) as exc:
        raise RuntimeError(f"FSDPEngine: cannot load a causal LM from {path} with attention "
                           f"{attn_implementation!r}: {exc}") from exc
    lm.config.use_cache = False
    _no_dropout(lm)
    if cp > 1:
        if not attention.supports(lm.config):
            raise NotImplementedError(f"FSDPEngine: context parallel (c{cp}) attends with a causal "
                                      f"same-sequence mask only; {type(lm).__name__} has sliding-window layers "
                                      f"or attention-logit soft-capping. Use d instead of c")
        context.register()  # local queries against all-gathered keys (see areal_fsdp.context)
        lm.set_attn_implementation(context.CP_SDPA)
    elif attn_implementation == "sdpa" and attention.supports(lm.config):
        attention.register()  # the same kernel, one packed sequence at a time (see areal_fsdp.attention)
        lm.set_attn_implementation(attention.PACKED_SDPA)
    return lm


def checkpoint_activations(lm: nn.Module) -> None:
    """Activation (gradient) checkpointing of each decoder layer, non-reentrant."""
    if not getattr(lm, "supports_gradient_checkpointing", False):
        raise ValueError(f"FSDPEngine: {type(lm).__name__} does not support gradient checkpointing; "
                         f"set actor.gradient_checkpointing: false")
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        lm.activation_checkpointing_enable({"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _no_dropout(lm: nn.Module) -> None:
    """Dropout off everywhere: forward_logprobs and train_batch must see the same function."""
    for module in lm.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


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
