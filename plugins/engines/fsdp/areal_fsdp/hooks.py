"""Placement declaration and plan rules of the ``fsdp`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without torch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.allocation import Allocation, Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import BackendSupport
from areal_core.parallelism_rules import heads_problem

BACKEND = "fsdp"

# Context parallel only makes sense on GPU here: ring attention needs NCCL
# kernels, which gloo does not provide. Data and tensor parallel run on both.
CONTEXT_NEEDS_GPU = "context parallel needs ring-attention kernels, which gloo does not provide"


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
    par = comp.parallel
    if comp.device == "cpu" and par.c > 1:
        # Fold every dimension that cannot run here into data parallel for the suggested fix.
        folded = replace(comp, parallel=replace(par, d=par.d * par.c * par.t, c=1, t=1))
        return [Problem(
            f"{BACKEND}.context-needs-gpu",
            f"'{comp}': c{par.c} on cpu is not supported: {CONTEXT_NEEDS_GPU}.",
            f"use data parallel instead, e.g. '{folded}', or place it on gpu (drop '@cpu')",
            key="allocation",
        )]
    problems = _not_built_problems(comp)
    problem = heads_problem(f"{BACKEND}.tensor-heads", comp, par.t, model)
    return problems + ([problem] if problem else [])


# What the engine of this version trains with (data, tensor, and tensor x data
# parallel); the declaration above is what the backend will support. Reported
# at check time rather than at start-up.
BUILT_DIMS = "dt"


def _not_built_problems(comp: Component) -> list[Problem]:
    par = comp.parallel
    missing = [dim for dim in ("t", "c") if getattr(par, dim) > 1 and dim not in BUILT_DIMS]
    if not missing:
        return []
    # Fold what is not built into data parallel; what is built stays as asked.
    folded = replace(comp, parallel=replace(par, d=par.d * math.prod(getattr(par, dim) for dim in missing),
                                            **{dim: 1 for dim in missing}))
    what = " and ".join(f"{'tensor' if dim == 't' else 'context'} parallel ({dim}{getattr(par, dim)})"
                        for dim in missing)
    return [Problem(
        f"{BACKEND}.not-built",
        f"'{comp}': {what} is not built in this version of areal-plugin-fsdp, which trains with data "
        "and tensor parallelism.",
        f"use data parallel instead, e.g. '{folded}'",
        key="allocation",
    )]
