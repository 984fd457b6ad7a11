"""Placement declaration and plan rules of the ``fsdp`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without torch.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem
from areal_core.config.allocation import Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import declare_backend, validate_components
from areal_core.parallelism_rules import heads_problem

BACKEND = "fsdp"


def _component_problems(config: Any, comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    # Data, tensor and context parallel are built alone and in every combination, on gpu and cpu alike (context
    # parallel all-gathers keys and values, which gloo does as nccl does); what is left to judge is whether t
    # splits the model's heads. Other dimensions (p, e) are refused by the core: this backend does not declare them.
    return [heads_problem(f"{BACKEND}.tensor-heads", comp, comp.parallel.t, model)]


areal_declare_backends = declare_backend(
    BACKEND, "train", dims="dtc", devices=("gpu", "cpu"),
    description="PyTorch FSDP2 trainer: data, tensor and context parallel",
)
areal_validate_parallelism = validate_components(BACKEND, _component_problems)
