"""Placement declaration and plan rules of the ``fsdp`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without torch.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem
from areal_core.config.allocation import Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import declare_backend, role_of, validate_components
from areal_core.parallelism_rules import heads_problem

BACKEND = "fsdp"


def _component_problems(config: Any, comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    # Data, tensor and context parallel are built alone and in every combination, on gpu and cpu alike (context
    # parallel all-gathers keys and values, which gloo does as nccl does); what is left to judge is whether t
    # splits the model's heads. Other dimensions (p, e) are refused by the core: this backend does not declare them.
    return [heads_problem(f"{BACKEND}.tensor-heads", comp, comp.parallel.t, model), _critic_problem(comp)]


def _critic_problem(comp: Component) -> Problem | None:
    """What ``FSDPEngine.initialize`` refuses for a critic: its value head is not split over tensor ranks."""
    if role_of(comp, "train") != "critic" or comp.parallel.t <= 1:
        return None
    return Problem(f"{BACKEND}.critic-tensor-parallel",
                   f"'{comp}': a critic with tensor parallel (t{comp.parallel.t}) is not built by areal-plugin-fsdp "
                   f"(its value head is not split over tensor ranks).",
                   f"place the critic with data parallel only, e.g. '{BACKEND}[critic]:d{comp.parallel.world_size}"
                   f"{'@cpu' if comp.device == 'cpu' else ''}'", key="allocation")


areal_declare_backends = declare_backend(
    BACKEND, "train", dims="dtc", devices=("gpu", "cpu"),
    description="PyTorch FSDP2 trainer: data, tensor and context parallel",
)
areal_validate_parallelism = validate_components(BACKEND, _component_problems)
