"""Helpers for engine plugins' plan tests: call the placement hooks directly, as the core would.

::

    from areal_core.testing.plans import codes, core_problems, declared, registered_hooks, validate_plan

The rules a test checks stay in the test; these only build the arguments and
pick out what the assertions compare.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from areal_core.config.allocation import parse_allocation
from areal_core.config.model_info import ModelInfo
from areal_core.config.schema import RunConfig
from areal_core.parallelism import BackendSupport, core_plan_problems
from areal_core.plugins import manager_from_modules
from areal_core.problems import Problem

__all__ = ["GEN", "TRAINER", "codes", "core_problems", "declared", "registered_hooks", "validate_plan"]

# Any inference backend, so the core's "needs an inference engine" rule stays quiet.
GEN = BackendSupport("gen", "inference", dims="d", devices=("gpu", "cpu"))
# Any train backend, so the core's "needs a train engine" rule stays quiet.
TRAINER = BackendSupport("trainer", "train", dims="d", devices=("gpu", "cpu"))


def validate_plan(
    hook: Callable[..., list[Problem]], text: str, model: ModelInfo | None, config: Any = None
) -> list[Problem]:
    """The problems an ``areal_validate_parallelism`` hook reports for allocation ``text``
    (with a default ``RunConfig`` unless ``config`` is given)."""
    return hook(config=RunConfig() if config is None else config, allocation=parse_allocation(text), model=model)


def codes(problems: list[Problem]) -> list[str]:
    return [p.code for p in problems]


def declared(declare: Callable[[], list[BackendSupport]]) -> tuple[str, str, str, tuple[str, ...]]:
    """``(backend, kind, dims, devices)`` of the one backend an ``areal_declare_backends`` hook declares."""
    (support,) = declare()
    return (support.backend, support.kind, support.dims, support.devices)


def registered_hooks(module: ModuleType, name: str) -> tuple[list[str], list[str]]:
    """The warnings and the hook names of ``module`` registered as plugin ``name``."""
    manager = manager_from_modules(module, names=[name])
    return manager.warnings(), manager.plugins[name].hooks


def core_problems(text: str, *supports: BackendSupport) -> list[Problem]:
    """The core's own plan problems for allocation ``text`` with only ``supports`` declared."""
    return core_plan_problems(parse_allocation(text), {b.backend: b for b in supports})
