"""Placement declaration of the ``local`` backend.

Imports only :mod:`areal_core`. The backend accepts data parallelism only
(one generator process per d, on CPU); the core rejects every other
dimension and device, so this plugin adds no plan rules of its own.
"""

from __future__ import annotations

from areal_core import hookimpl
from areal_core.parallelism import BackendSupport

BACKEND = "local"


@hookimpl
def areal_declare_backends() -> list[BackendSupport]:
    return [
        BackendSupport(
            BACKEND,
            "inference",
            dims="d",
            devices=("cpu",),
            description="embedded CPU generator, one process per d",
        )
    ]
