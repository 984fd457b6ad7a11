"""Where a run's model lives: ``model.path`` resolved to a local HF folder.

A local folder is taken as it is; a Hugging Face Hub id (``ORG/NAME[@REVISION]``) is downloaded into
huggingface_hub's cache (:mod:`areal_core.hub`).

``model.path: ""`` means the built-in demo model, which a plugin provides
through the ``areal_resolve_model`` hook (``areal-plugin-local`` converts
SmolLM2-135M-Instruct once into a user cache). Engines, workflows (for the
tokenizer) and benchmarks all call :func:`resolve_model_path`, so none of
them imports another plugin to find the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_core.config.dtype import resolve_dtype


class ModelNotFoundError(FileNotFoundError):
    """``model.path`` names no local folder and no plugin provides it."""


def resolve_model_path(path: str, dtype: str = "auto") -> Path:
    """A local folder for ``path`` (``""`` = the demo model), asking plugins when it is not a folder."""
    if path:
        folder = Path(path).expanduser()
        if folder.is_dir():
            return folder
    from areal_core.plugins import get_plugin_manager

    concrete = resolve_dtype(dtype)
    answer = get_plugin_manager().hook.areal_resolve_model(path=path, dtype=concrete, materialize=True)
    if answer is not None:
        return Path(answer)
    from areal_core.hub import model_folder, parse_hub_id

    if parse_hub_id(path) is not None:  # ORG/NAME[@REVISION]: downloaded into huggingface_hub's cache
        return model_folder(path)
    if not path:
        from areal_core.catalogue import install_line

        raise ModelNotFoundError(
            "model.path is '' (the built-in demo model) but no installed plugin provides it; it comes with "
            f"areal-plugin-local ({install_line('areal-plugin-local')}), or set model.path to a Hugging Face "
            "model folder (config.json + safetensors) or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct")
    raise ModelNotFoundError(
        f"model.path {path!r} is not a folder and no installed plugin knows it. Fix: point model.path at a "
        f"local Hugging Face model folder (config.json + safetensors), or name a hub model as ORG/NAME[@REVISION]")


def model_path_of(config: Any) -> Path:
    """:func:`resolve_model_path` for a :class:`~areal_core.config.RunConfig`."""
    return resolve_model_path(config.model.path, config.model.dtype)


def load_tokenizer(config_or_path: Any) -> Any:
    """The run's tokenizer (transformers ``AutoTokenizer``), from a RunConfig or a folder."""
    from transformers import AutoTokenizer

    folder = Path(config_or_path) if isinstance(config_or_path, (str, Path)) else model_path_of(config_or_path)
    return AutoTokenizer.from_pretrained(str(folder))
