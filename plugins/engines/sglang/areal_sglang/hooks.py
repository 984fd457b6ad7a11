"""Placement declaration and plan rules of the ``sglang`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without sglang.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.allocation import Allocation, Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import BackendSupport
from areal_core.parallelism_rules import divisors, experts_problem, heads_problem, layers_problem
from areal_core.remote import addresses_problem

BACKEND = "sglang"


@hookimpl
def areal_declare_backends() -> list[BackendSupport]:
    # GPU only: SGLang publishes no CPU kernels on PyPI.
    return [
        BackendSupport(
            BACKEND,
            "inference",
            dims="dtpe",
            devices=("gpu",),
            description="SGLang servers: d servers, each over t x p GPUs, expert parallel inside t",
        )
    ]


@hookimpl
def areal_validate_parallelism(
    config: Any, allocation: Allocation, model: ModelInfo | None
) -> list[Problem]:
    problems: list[Problem] = []
    for comp in allocation.find(backend=BACKEND):
        problems.extend(_component_problems(comp, model))
        extra = getattr(getattr(config, "rollout", None), "extra", None) or {}
        attach = addresses_problem(BACKEND, comp.parallel.d, extra.get("addresses"))
        problems.extend([attach] if attach is not None else [])
    return problems


def _component_problems(comp: Component, model: ModelInfo | None) -> list[Problem]:
    par = comp.parallel
    # SGLang replicates key-value heads when t is a multiple of their count.
    found = [
        heads_problem(f"{BACKEND}.tensor-heads", comp, par.t, model, kv_replication=True),
        layers_problem(f"{BACKEND}.pipeline-layers", comp, par.p, model),
        _expert_tensor_problem(comp),
        experts_problem(BACKEND, comp, par.e, model),
    ]
    return [problem for problem in found if problem is not None]


def _expert_tensor_problem(comp: Component) -> Problem | None:
    par = comp.parallel
    # SGLang's expert parallel group lives inside the tensor parallel group.
    if par.e <= 1 or par.t % par.e == 0:
        return None
    return Problem(
        f"{BACKEND}.expert-tensor",
        f"'{comp}': expert parallel size e{par.e} must divide the tensor parallel size "
        f"t{par.t}; SGLang runs expert parallel inside the tensor parallel group.",
        f"choose e from {', '.join(map(str, divisors(par.t)))}, "
        f"or raise t to a multiple of e{par.e}",
        key="allocation",
    )
