"""Checks of the ``dataset`` section when it selects one of this plugin's datasets.

The options' types and ranges are the core's job; these rules span keys (or
the file system) and are reported by ``areal check`` with every other problem.
Imports nothing heavy: the dataset modules named here import only the core.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from areal_core import Problem, hookimpl


def _options(config_class: type, extra: dict) -> Any:
    names = {f.name for f in dataclasses.fields(config_class)}
    return dataclasses.replace(config_class(), **{k: v for k, v in extra.items() if k in names})


def _files_problems(extra: dict) -> list[Problem]:
    problems = []
    path = extra.get("path", "")
    if not path:
        problems.append(Problem("tasks.no-path", "the files dataset needs a file or folder to read",
                                "set dataset.path to a .jsonl / .parquet file or a save_to_disk folder",
                                "dataset.path"))
    for key in ("path", "validation_path"):
        value = extra.get(key, "")
        if value and isinstance(value, str) and not Path(value).expanduser().exists():
            problems.append(Problem("tasks.missing-file", f"{value} does not exist",
                                    f"point dataset.{key} at an existing file or folder", f"dataset.{key}"))
    return problems


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    name, extra = config.dataset.name, dict(config.dataset.extra)
    if name == "files":
        return _files_problems(extra)
    if name in ("arithmetic", "countdown"):
        if name == "arithmetic":
            from areal_tasks.arithmetic import ArithmeticDataset as dataset
        else:
            from areal_tasks.countdown import CountdownDataset as dataset
        try:
            options = _options(dataset.config_class, extra)
            return dataset.option_problems(options)
        except (TypeError, ValueError):  # a mistyped key: the core reports it already
            return []
    return []
