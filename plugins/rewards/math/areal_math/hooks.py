"""Hooks of areal-plugin-math: config checks only (nothing heavy is imported)."""

from __future__ import annotations

from typing import Any

from areal_core import hookimpl
from areal_core.problems import Problem


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    """``reward.tags`` of the format reward must be a list of tag names."""
    reward = config.reward
    if reward.name != "format" or "tags" not in reward.extra:
        return []
    from areal_math.format import tag_problems

    return [Problem("math.format-tags", message, fix, key=key)
            for key, message, fix in tag_problems(reward.extra["tags"])]
