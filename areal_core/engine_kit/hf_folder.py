"""Writing a Hugging Face model folder (safetensors + config.json) that appears all at once.

What is written is what ``save_pretrained`` writes for the same weights: HF
checkpoint names (transformers' own load-time renamings reverted, a no-op for
Llama / Qwen2), tied aliases left out (``lm_head.weight`` when it is the
input embedding), ``model.safetensors`` or shards of at most
``max_shard_bytes`` with ``model.safetensors.index.json``, ``config.json``
carrying the dtype of the files, ``generation_config.json``, and the
tokenizer files of the folder the model came from. :func:`read_hf_weights`
reads such a folder's tensors back. torch, safetensors and transformers are
imported on first use.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_core.checkpoint import atomic_dir

if TYPE_CHECKING:
    import torch

MAX_SHARD_BYTES = 5 * 1024**3
# Files of a model folder that are not weights and travel with them (tokenizer, chat template, ...).
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
# generation_config.json is copied only when the model did not write its own (see copy_side_files).
NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json", "areal-converted.json"}


def checkpoint_names(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (module names) renamed as transformers would save it (identity for most models)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: module names are checkpoint names
        return state_dict
    return dict(revert_weight_conversion(model, state_dict))


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """``model.safetensors``, or shards and their index, in ``folder``."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_bytes)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_hf_folder(path: str | os.PathLike[str], model: Any, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                    source: str | os.PathLike[str] | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """:func:`write_hf_files` into a staging folder renamed to ``path`` when complete
    (:func:`areal_core.checkpoint.atomic_dir`: readers see the old folder or the new one)."""
    with atomic_dir(path) as folder:
        write_hf_files(folder, model, state_dict, dtype, source, max_shard_bytes)


def write_hf_files(folder: Path, model: Any, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                   source: str | os.PathLike[str] | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """The files of a HF model folder for the transformers ``model`` holding ``state_dict`` (module names),
    written into the existing ``folder``: :func:`write_hf_tensors` with the model's config and generation
    config."""
    write_hf_tensors(folder, checkpoint_names(model, state_dict), dtype, model.config,
                     getattr(model, "generation_config", None), source, max_shard_bytes)


def write_hf_tensors(folder: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, config: Any,
                     generation_config: Any = None, source: str | os.PathLike[str] | None = None,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """``tensors`` (checkpoint names) and ``config`` as a HF model folder in the existing ``folder`` (older
    weight files removed).

    Floating-point tensors are cast to ``dtype``; ``config.json`` says so.
    Side files (tokenizer, chat template, a generation config when none is
    given) are copied from ``source``.
    """
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu() for name, t in tensors.items()}
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    write_weights(folder, tensors, max_shard_bytes)
    config = copy.deepcopy(config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.use_cache = True  # training turns the KV cache off; a reader of the folder wants it back
    config.save_pretrained(str(folder))
    if generation_config is not None:
        generation_config.save_pretrained(str(folder))
    if source:
        copy_side_files(Path(source), folder)


def read_hf_weights(folder: str | os.PathLike[str], who: str = "the engine") -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a HF model folder (CPU); ``who`` names the reader in the
    error for a folder without them."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{who}: {folder} holds no *.safetensors weights; model.path must be a "
                                f"Hugging Face model folder (safetensors + config.json)")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    return out


def copy_side_files(source: Path, folder: Path) -> None:
    """Tokenizer and other small non-weight files of ``source`` (never config or weights)."""
    if not source.is_dir():
        return
    for file in sorted(source.iterdir()):
        if file.is_file() and file.suffix in SIDE_FILE_SUFFIXES and file.name not in NOT_SIDE_FILES \
                and not (folder / file.name).exists():
            shutil.copy2(file, folder / file.name)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
