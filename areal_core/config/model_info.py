"""What validation may know about a model without loading it: its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelInfo:
    """Shape facts read from an HF ``config.json``; None where the file does not say."""

    path: str
    model_type: str | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    # The whole config.json, for a plugin's plan rules that judge what the fields above do not say (its
    # activation, biases): read, never written.
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts and self.num_experts > 1)


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def read_model_info(path: str) -> ModelInfo | None:
    """Read ``path/config.json`` (for a hub id, the copy in huggingface_hub's cache, which ``areal check`` fetched);
    None when there is no such file (yet)."""
    if not path:
        return None
    try:
        folder = Path(path).expanduser()
        local = folder.is_dir()
    except (OSError, ValueError, RuntimeError):  # too long a name, a NUL byte, '~nobody' names no home folder
        return None
    if not local:
        from areal_core.hub import cached_config_folder

        folder = cached_config_folder(path) or folder
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RuntimeError):  # RuntimeError: '~nobody' names no home folder
        return None
    if not isinstance(raw, dict):
        return None

    def as_int(key: str) -> int | None:
        value = raw.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    experts = next((as_int(k) for k in _EXPERT_KEYS if as_int(k) is not None), None)
    heads = as_int("num_attention_heads")
    return ModelInfo(
        path=str(path),
        model_type=raw.get("model_type") if isinstance(raw.get("model_type"), str) else None,
        num_attention_heads=heads,
        num_key_value_heads=as_int("num_key_value_heads") or heads,
        num_hidden_layers=as_int("num_hidden_layers"),
        hidden_size=as_int("hidden_size"),
        vocab_size=as_int("vocab_size"),
        num_experts=experts,
        raw=raw,
    )
