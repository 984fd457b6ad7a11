"""Writing a Hugging Face model folder (safetensors + config.json) that appears all at once.

What is written is what ``save_pretrained`` writes for the same weights: HF
checkpoint names (transformers' own load-time renamings reverted, a no-op for
Llama / Qwen2), tied aliases left out (``lm_head.weight`` when it is the
input embedding), ``model.safetensors`` or shards of at most
``max_shard_bytes`` with ``model.safetensors.index.json``, ``config.json``
carrying the dtype of the files, ``generation_config.json``, and the
tokenizer files of the folder the model came from.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from areal_core.checkpoint import atomic_dir

MAX_SHARD_BYTES = 5 * 1024**3
# Files of a model folder that are not weights and travel with them (tokenizer, chat template, ...).
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
NOT_SIDE_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "areal-converted.json"}


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
    """The files of a HF model folder, written into the existing ``folder`` (older weight files removed).

    Floating-point tensors are cast to ``dtype``; ``config.json`` says so.
    Side files (tokenizer, chat template) are copied from ``source``.
    """
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu()
               for name, t in checkpoint_names(model, state_dict).items()}
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    write_weights(folder, tensors, max_shard_bytes)
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.use_cache = True  # training turns the KV cache off; a reader of the folder wants it back
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(folder))
    if source:
        copy_side_files(Path(source), folder)


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
