"""Where a train engine starts: its run config, its device and its model folder."""

from __future__ import annotations

import os
from typing import Any


def run_config(context: Any) -> Any:
    """The run config the engine was built with, or the core defaults for an engine built bare (tests)."""
    if getattr(context, "config", None) is not None:
        return context.config
    from areal_core.config.schema import RunConfig

    return RunConfig()


def pick_device(context: Any, engine: str) -> Any:
    """The ``torch.device`` of this rank: its CUDA device (``LOCAL_RANK``) unless the allocation placed the
    actor ``@cpu`` or there is none; a ``gpu`` placement without CUDA is an error naming the fix."""
    import torch

    wanted = getattr(getattr(context, "placement", None), "device", None)
    if wanted != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    if wanted == "gpu":
        raise RuntimeError(f"{engine}: the allocation places the actor on gpu but torch sees no CUDA device "
                           f"(torch {torch.__version__}); place it with '@cpu' or install a CUDA build of torch")
    return torch.device("cpu")


def model_folder(path: str, dtype: str) -> str:
    """``model.path`` as a local HF folder (a name a plugin resolves is materialised in ``dtype``)."""
    from areal_core.models import resolve_model_path

    return str(resolve_model_path(path, dtype))
