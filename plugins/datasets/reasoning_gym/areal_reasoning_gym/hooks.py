"""Checks of ``dataset`` when it selects ``reasoning_gym``, run by ``areal check`` / ``areal run`` before anything starts.

Imported on every ``areal`` call, so nothing heavy at module load;
reasoning-gym itself (a few seconds to import) only when the run selects
this dataset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_core import Problem, hookimpl


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    if config.dataset.name != "reasoning_gym":
        return []
    from areal_reasoning_gym.dataset import ReasoningGymConfig, make_task

    extra = dict(config.dataset.extra)
    names = {f.name for f in dataclasses.fields(ReasoningGymConfig)}
    try:
        options = dataclasses.replace(ReasoningGymConfig(), **{k: v for k, v in extra.items() if k in names})
    except (TypeError, ValueError):  # a mistyped key: the core reports it already
        return []
    if not isinstance(options.task, str) or not isinstance(options.task_options, dict):
        return []  # a wrong type: the core reports it already
    try:  # one problem is enough to know the task exists and takes these options
        make_task(options.task, 0, 1, dict(options.task_options))
    except ValueError as exc:
        message, _, fix = str(exc).partition(" Fix: ")
        key = "dataset.task_options" if "task_options" in message else "dataset.task"
        return [Problem("reasoning_gym.task", message, fix, key)]
    if config.eval.size > 0 and options.validation_size == 0:
        return [Problem("reasoning_gym.no-validation",
                        f"eval.size is {config.eval.size} but dataset.validation_size is 0: there is nothing to "
                        f"evaluate on", "set dataset.validation_size (e.g. 64), or eval.size=0 for a run without "
                        "evaluation", "dataset.validation_size")]
    return []
