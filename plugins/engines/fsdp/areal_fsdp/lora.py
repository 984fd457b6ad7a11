"""LoRA through PEFT: adapters injected into the HF model, and how its weights are named on the way out.

PEFT (the plugin's ``lora`` extra: ``peft>=0.13``) replaces each targeted
``nn.Linear`` ``X`` with a LoRA layer holding ``X.base_layer`` (the frozen
weight) and ``X.lora_A.default`` / ``X.lora_B.default`` (the trained
adapters). The HF model object stays the same, so the engine shards and
trains it as before; only the adapters require grad.

What leaves the engine is named as the plain model names it:

- merged: ``X.weight = base + (B @ A) * scaling`` (``scaling`` is PEFT's own,
  ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA), the adapters left
  out: what an inference engine loads;
- base: ``X.weight = base``: the frozen weights a checkpoint keeps beside the
  adapters (exact resume);
- adapters: PEFT's file format (``adapter_config.json`` +
  ``adapter_model.safetensors``, names ``base_model.model.X.lora_A.weight``),
  loadable with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ADAPTER = "default"  # PEFT's name for the one adapter
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def add_lora(lm: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str], seed: int) -> Any:
    """Inject LoRA layers into ``lm`` in place (everything else frozen); returns the PEFT model wrapping it.

    The adapters' random initialisation is drawn from ``seed`` (the global RNG
    left as it was), so every rank, at any world size, starts from the same
    adapters before sharding.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("FSDPEngine: actor.lora_rank > 0 trains LoRA adapters through PEFT, which is not "
                          "installed; pip install 'peft>=0.13' (the plugin's lora extra), or set "
                          "actor.lora_rank=0") from exc
    target: Any = "all-linear" if list(targets) == ["all-linear"] else list(targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target, bias="none",
                        task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(lm, config)
    except ValueError as exc:
        raise ValueError(f"FSDPEngine: actor.lora_target_modules {list(targets)!r} does not fit "
                         f"{type(lm).__name__}: {exc}. Name linear submodules such as q_proj, v_proj, or use "
                         f"['all-linear']") from exc
    if peft_model.base_model.model is not lm:  # the engine relies on in-place injection
        raise RuntimeError("FSDPEngine: this PEFT version wraps a copy of the model; LoRA needs peft >= 0.13")
    return peft_model


def lora_layers(lm: nn.Module) -> dict[str, tuple[float, bool]]:
    """{module name: (scaling, fan_in_fan_out)} of every LoRA layer of ``lm``."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: (float(m.scaling[ADAPTER]), bool(getattr(m, "fan_in_fan_out", False)))
            for name, m in lm.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.scaling}


def is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def plain_name(name: str) -> str:
    """``X.base_layer.weight`` -> ``X.weight`` (what the model without LoRA calls it)."""
    return name.replace(".base_layer.", ".")


Combine = Callable[[list[torch.Tensor]], torch.Tensor]


def export_items(names: list[str], layers: dict[str, tuple[float, bool]],
                 merged: bool) -> list[tuple[str, list[str], Combine | None]]:
    """(exported name, source state-dict names, how to combine them) for each exported tensor, in order."""
    items: list[tuple[str, list[str], Combine | None]] = []
    for name in names:
        if is_adapter(name):
            continue
        module, _, leaf = name.rpartition(".base_layer.")
        if merged and module in layers and leaf == "weight":
            scaling, transposed = layers[module]
            sources = [name, f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"]
            items.append((plain_name(name), sources, _merger(scaling, transposed)))
        else:
            items.append((plain_name(name), [name], None))
    return items


def _merger(scaling: float, transposed: bool) -> Combine:
    def merge(tensors: list[torch.Tensor]) -> torch.Tensor:
        base, a, b = tensors
        delta = (b.float() @ a.float()) * scaling
        return (base.float() + (delta.T if transposed else delta)).to(base.dtype)

    return merge


def module_names(plain: dict[str, torch.Tensor], own: list[str]) -> dict[str, torch.Tensor]:
    """A plain (un-LoRA'd) state dict renamed to the LoRA model's base names (adapters not included)."""
    out = {}
    for name in own:
        if not is_adapter(name) and plain_name(name) in plain:
            out[name] = plain[plain_name(name)]
    return out


def to_peft_names(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): t for n, t in adapters.items()}


def from_peft_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = t
    return out


def write_adapter(folder: str | os.PathLike[str], adapters: dict[str, torch.Tensor], peft_model: Any,
                  dtype: torch.dtype, source: str | None) -> None:
    """PEFT's adapter folder (config + safetensors) in the existing ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {n: t.to(dtype).contiguous() for n, t in to_peft_names(adapters).items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_model.peft_config[ADAPTER]
    previous = config.base_model_name_or_path
    config.base_model_name_or_path = source or previous
    try:
        config.save_pretrained(str(folder))
    finally:
        config.base_model_name_or_path = previous


def read_adapter(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"FSDPEngine.load: {path} is missing: this engine trains LoRA adapters "
                                f"(actor.lora_rank > 0) and the folder holds none; save it with the same "
                                f"actor.lora_* keys, or set actor.lora_rank=0 to load a full model")
    return from_peft_names(load_file(str(path)))
