"""Placement declaration and plan rules of the ``sglang`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without sglang.
"""

from __future__ import annotations

from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.allocation import Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import declare_backend, validate_components
from areal_core.parallelism_rules import divisors, experts_problem, heads_problem, layers_problem
from areal_core.remote import rollout_addresses_problem, server_python_problem

BACKEND = "sglang"


def _component_problems(config: Any, comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    par = comp.parallel
    # SGLang replicates key-value heads when t is a multiple of their count.
    return [
        heads_problem(f"{BACKEND}.tensor-heads", comp, par.t, model, kv_replication=True),
        layers_problem(f"{BACKEND}.pipeline-layers", comp, par.p, model),
        _expert_tensor_problem(comp),
        experts_problem(BACKEND, comp, par.e, model),
        rollout_addresses_problem(BACKEND, config, comp),
    ]


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    """The servers' interpreter has a supported SGLang (what SGLangEngine.start checks once a server is up)."""
    from areal_sglang.engine import PYTHON_ENV, SUPPORTED, server_python  # no sglang import: the plugin's own

    extra = getattr(getattr(config, "rollout", None), "extra", None) or {}
    python = server_python(extra.get("python") or "")
    problem = server_python_problem(BACKEND, config, python, "sglang", SUPPORTED,
                                    f"point rollout.python (or ${PYTHON_ENV}) at an interpreter with SGLang "
                                    f"{SUPPORTED} (GPU machines), or attach to running servers with rollout.addresses")
    return [problem] if problem else []


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


# GPU only: SGLang publishes no CPU kernels on PyPI.
areal_declare_backends = declare_backend(
    BACKEND, "inference", dims="dtpe", devices=("gpu",),
    description="SGLang servers: d servers, each over t x p GPUs, expert parallel inside t",
)
areal_validate_parallelism = validate_components(BACKEND, _component_problems)
