"""Placement declaration and plan rules of the ``fsdp`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without torch.
"""

from __future__ import annotations

from dataclasses import replace
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
    problems = _not_built_problems(comp)
    problem = heads_problem(f"{BACKEND}.tensor-heads", comp, comp.parallel.t, model)
    return problems + ([problem] if problem else [])


# Data, tensor and context parallel each run on gpu and cpu (context parallel all-gathers keys and values,
# which gloo does as nccl does); what the engine of this version does not combine is context with tensor
# parallel. Reported at check time rather than at start-up.
def _not_built_problems(comp: Component) -> list[Problem]:
    par = comp.parallel
    if par.c == 1 or par.t == 1:
        return []
    # Either dimension alone is built: fold the other into data parallel, or the tensor into context parallel.
    as_context = replace(comp, parallel=replace(par, c=par.c * par.t, t=1))
    as_tensor = replace(comp, parallel=replace(par, d=par.d * par.c, c=1))
    return [Problem(
        f"{BACKEND}.not-built",
        f"'{comp}': context parallel (c{par.c}) together with tensor parallel (t{par.t}) is not built in this "
        "version of areal-plugin-fsdp, which trains with data parallel beside either one of them.",
        f"use context parallel only, e.g. '{as_context}', or tensor parallel only, e.g. '{as_tensor}'",
        key="allocation",
    )]
