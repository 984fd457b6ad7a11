"""Hooks of areal-plugin-agent: config checks only (nothing heavy is imported)."""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_core import hookimpl
from areal_core.problems import Problem


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    """``workflow.agent`` / ``workflow.agent_command``: exactly one, the command a list of strings, the agent
    importable."""
    if config.workflow.name != "agent":
        return []
    from areal_agent.config import AgentConfig, config_problems

    names = {f.name for f in dataclasses.fields(AgentConfig)}
    try:
        options = AgentConfig(**{k: v for k, v in dict(config.workflow.extra).items() if k in names})
    except (TypeError, ValueError):  # a mistyped key: the core reports it already
        return []
    problems = [Problem("agent.config", message, fix, key) for key, message, fix in config_problems(options)]
    if options.agent and not problems:
        from areal_core.rewards import TargetError, load_target

        try:
            load_target(options.agent, "workflow.agent")
        except TargetError as exc:
            problems.append(Problem("agent.target", exc.why, exc.fix, "workflow.agent"))
    return problems
