"""Checks of the ``dataset`` section when it selects one of this plugin's datasets.

The options' types and ranges are the core's job; these rules span keys, the
file system and the data itself (every row of a ``files`` dataset is read),
and are reported by ``areal check`` / ``areal run`` with every other problem,
before any process starts. Imports nothing heavy at module load: the dataset
modules named here import only the core (pyarrow / datasets only when such a
file is read).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from areal_core import Problem, hookimpl


def _options(config_class: type, extra: dict) -> Any | None:
    """The dataset's options built from ``extra``, or None when a key has a wrong type or range (the core
    reports those; checking data against half-valid options would only add noise)."""
    from areal_core.config.load import build

    scratch: list[Problem] = []
    options = build(config_class, extra, "dataset.", scratch)
    return None if scratch else options


def _files_problems(config: Any, extra: dict) -> list[Problem]:
    problems = []
    path = extra.get("path", "")
    if not path:
        problems.append(Problem("tasks.no-path", "the files dataset needs a file or folder to read",
                                "set dataset.path to a .jsonl / .parquet file or a save_to_disk folder",
                                "dataset.path"))
    for key in ("path", "validation_path"):
        value = extra.get(key, "")
        if value and isinstance(value, str) and not _exists(value):
            problems.append(Problem("tasks.missing-file", f"{value} does not exist",
                                    f"point dataset.{key} at an existing file or folder", f"dataset.{key}"))
    return problems or _rows_problems(config, extra)


def _exists(path: str) -> bool:
    """False too for a name the file system refuses (too long, a NUL byte) and for '~nobody/...'; an hf:// path
    and a hub dataset id pass here."""
    from areal_tasks.files import hub_repo

    if path.startswith("hf://") or hub_repo(path) is not None:
        return True  # a hub file or dataset: reading the rows fetches it, and says what is wrong with it
    try:
        return Path(path).expanduser().exists()
    except (OSError, ValueError, RuntimeError):
        return False


def _rows_problems(config: Any, extra: dict) -> list[Problem]:
    """Read every row now, as the trainer would when it starts, so a bad row is reported before anything runs.

    The split read is the one the run needs last: validation when ``eval.size`` > 0
    (building it reads the train file too, and finds an empty validation split),
    else train.
    """
    import re

    from areal_core.api import Context
    from areal_tasks.files import DatasetFileError, FilesConfig, FilesDataset

    options = _options(FilesConfig, extra)
    if options is None:
        return []
    if options.answer_pattern:
        try:
            re.compile(options.answer_pattern)
        except re.error as exc:
            return [Problem("tasks.answer-pattern", f"{options.answer_pattern!r} is not a regular expression: {exc}",
                            "correct dataset.answer_pattern (GSM8K: '####\\s*(.+)$')", "dataset.answer_pattern")]
    split = "validation" if config.eval.size > 0 else "train"
    try:
        FilesDataset(Context(config=config, options=options, extras={"split": split}))
    except DatasetFileError as exc:
        return [Problem("tasks.bad-data", exc.message, exc.fix, exc.key)]
    except Exception as exc:  # pyarrow / datasets on a corrupt or foreign file: say which, not a traceback
        return [Problem("tasks.unreadable", f"{options.path} cannot be read as {options.format}: "
                        f"{type(exc).__name__}: {str(exc)[:300]}",
                        "point dataset.path at a valid .jsonl / .parquet file or save_to_disk folder, or set "
                        "dataset.format", "dataset.path")]
    return []


def _synthetic_problems(config: Any, dataset: Any, extra: dict) -> list[Problem]:
    options = _options(dataset.config_class, extra)
    if options is None:
        return []
    problems = dataset.option_problems(options)
    if problems or config.eval.size == 0:
        return problems
    if options.validation_size == 0:
        return [Problem("tasks.no-validation", f"eval.size is {config.eval.size} but dataset.validation_size is 0: "
                        f"there is nothing to evaluate on",
                        "set dataset.validation_size (e.g. 64), or eval.size=0 for a run without evaluation",
                        "dataset.validation_size")]
    from areal_core.api import Context

    try:  # drawing the validation set is cheap, and finds a problem space too small for it
        dataset(Context(config=config, options=options, extras={"split": "validation"}))
    except ValueError as exc:
        message, _, fix = str(exc).partition(" Fix: ")
        return [Problem("tasks.too-few-problems", message, fix, "dataset.validation_size")]
    return []


@hookimpl
def areal_validate_config(config: Any) -> list[Problem]:
    name, extra = config.dataset.name, dict(config.dataset.extra)
    if name == "files":
        return _files_problems(config, extra)
    if name == "arithmetic":
        from areal_tasks.arithmetic import ArithmeticDataset

        return _synthetic_problems(config, ArithmeticDataset, extra)
    if name == "countdown":
        from areal_tasks.countdown import CountdownDataset

        return _synthetic_problems(config, CountdownDataset, extra)
    return []
