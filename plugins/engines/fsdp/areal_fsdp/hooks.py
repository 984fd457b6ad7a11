"""Placement declaration and plan rules of the ``fsdp`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without torch.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.allocation import Allocation, Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import BackendSupport
from areal_core.parallelism_rules import heads_problem

BACKEND = "fsdp"


@hookimpl
def areal_declare_backends() -> list[BackendSupport]:
    return [
        BackendSupport(
            BACKEND,
            "train",
            dims="dtc",
            devices=("gpu", "cpu"),
            description="PyTorch FSDP2 trainer: data, tensor and context parallel",
        )
    ]


@hookimpl
def areal_validate_parallelism(
    config: Any, allocation: Allocation, model: ModelInfo | None
) -> list[Problem]:
    problems: list[Problem] = []
    for comp in allocation.find(backend=BACKEND):
        problems.extend(_component_problems(comp, model))
    return problems


def _component_problems(comp: Component, model: ModelInfo | None) -> list[Problem]:
    # Data, tensor and context parallel are built alone and in every combination, on gpu and cpu alike (context
    # parallel all-gathers keys and values, which gloo does as nccl does); what is left to judge is whether t
    # splits the model's heads. Other dimensions (p, e) are refused by the core: this backend does not declare them.
    problem = heads_problem(f"{BACKEND}.tensor-heads", comp, comp.parallel.t, model)
    return [problem] if problem else []
