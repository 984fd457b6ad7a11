"""The core's built-in hooks, registered through the ``areal`` entry-point group
like any plugin's (entry point ``core`` of the ``areal-core`` distribution)."""

from __future__ import annotations

from typing import Any

from areal_core.config.allocation import Allocation
from areal_core.hookspecs import hookimpl
from areal_core.parallelism import BackendSupport, core_plan_problems, role_of
from areal_core.problems import Problem


@hookimpl(trylast=True)
def areal_validate_parallelism(
    config: Any, allocation: Allocation, backends: dict[str, BackendSupport]
) -> list[Problem]:
    """Rules for every plan, then agreement between the allocation and the config's backends."""
    problems = core_plan_problems(allocation, backends)
    for comp in allocation.components:
        support = backends.get(comp.backend)
        if support is None:
            continue
        role = role_of(comp, support.kind)
        section = {"actor": "actor", "rollout": "rollout"}.get(role)
        if section is None:
            continue
        configured = getattr(config, section).backend
        if configured != comp.backend:
            problems.append(Problem(
                "core.backend-mismatch",
                f"the allocation places '{comp}' as {section}, but {section}.backend is '{configured}'",
                f"set {section}.backend={comp.backend}, or change the allocation",
                key=f"{section}.backend"))
    return problems


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    """The built-in ``function`` and ``weighted`` rewards: a target that imports, parts that resolve; the metrics
    loggers: installed, jsonl among them."""
    from areal_core.metrics import logger_problems
    from areal_core.rewards import reward_problems

    problems = reward_problems(config.reward.name, dict(config.reward.extra), "reward")
    problems += logger_problems(config.metrics.loggers)
    k, groups = config.actor.ppo_minibatches, config.rollout.batch_size
    if k > groups:
        problems.append(Problem(
            "core.minibatches",
            f"actor.ppo_minibatches is {k} but a batch holds rollout.batch_size={groups} prompt groups, and a "
            f"group is never split across mini-batches",
            f"set actor.ppo_minibatches to at most {groups}, or raise rollout.batch_size",
            key="actor.ppo_minibatches"))
    return problems
