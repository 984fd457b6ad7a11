"""The core's built-in rewards: ``function`` (any callable named in config) and
``weighted`` (a weighted sum of other rewards, each resolved by name).

Both are glue with no dependency, so they ship with the core: a user with
only ``areal-core`` can still point ``reward`` at their own function, and
combining rewards from different plugins (``math`` with ``code``'s format
check, say) needs no plugin to import another.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_core.api.component import Component, Context
from areal_core.api.reward import Reward, call_reward
from areal_core.config.schema import spec
from areal_core.problems import Problem, ProblemsError

TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class TargetError(ValueError):
    """A ``target`` that cannot be used; says the key, the value, why, and the fix."""

    def __init__(self, key: str, target: Any, why: str, fix: str) -> None:
        self.key, self.why, self.fix = key, f"{target!r} {why}", fix
        super().__init__(f"{key}: {self.why}. Fix: {fix}")


def _import_here_too(module_name: str) -> Any:
    """``importlib.import_module``, also finding a module in the current folder, as ``python script.py`` and
    ``python -m`` do (and the run's trainer, started with ``-m`` from this folder, does): the ``areal`` console
    script's path starts at its own bin folder, so ``reward.target=my_reward:score`` beside the config was not
    found by ``areal check`` although the run would have found it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        here = Path.cwd()
        if exc.name != top or not ((here / f"{top}.py").is_file() or (here / top / "__init__.py").is_file()):
            raise
        if str(here) not in sys.path:
            sys.path.append(str(here))  # after installed packages: a local file never shadows one
        return importlib.import_module(module_name)


def load_target(target: str, key: str = "reward.target") -> Any:
    """Import ``"package.module:attribute"``, or raise :class:`TargetError`."""
    if not isinstance(target, str) or not TARGET.fullmatch(target):
        raise TargetError(key, target, "is not 'package.module:attribute'", f"write it like {key}=my_pkg.rewards:score")
    module_name, _, attr = target.partition(":")
    try:
        obj = _import_here_too(module_name)
    except Exception as exc:
        raise TargetError(key, target, f"cannot be imported: {type(exc).__name__}: {exc}",
                          f"install the package that provides {module_name}, put it in the folder you run areal "
                          f"from ({Path.cwd()}), or correct {key}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(key, target, f"names nothing: {module_name} has no attribute {attr!r}",
                              f"correct the name after ':' in {key}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(key, target, f"is {obj!r}, which is not callable",
                          "name a function (prompt, completion, item) -> float | dict, or a class of such callables")
    return obj


def instantiate(obj: Any, context: Context) -> Any:
    """A reward callable from what an entry point or a target names: functions as they are, classes built."""
    if isinstance(obj, type) and issubclass(obj, Component):
        return obj.create(context)
    if isinstance(obj, type):
        return obj()
    return obj


@dataclass
class FunctionConfig:
    """Keys of the ``reward`` section when ``reward.name: function``."""

    target: str = spec("", help="the reward callable as 'package.module:attribute'")


class FunctionReward(Reward):
    """``reward: {name: function, target: "my_pkg.my_mod:score"}``: use a plain callable as the reward.

    :meth:`create` returns the callable itself (a class is instantiated), so
    :func:`~areal_core.api.call_reward` sees whether it is async and awaits
    it, or runs it off the event loop when it is sync.
    """

    config_class = FunctionConfig

    @classmethod
    def create(cls, context: Context) -> Any:
        options = context.options or FunctionConfig()
        return instantiate(load_target(options.target), Context(config=context.config))


@dataclass
class WeightedConfig:
    """Keys of the ``reward`` section when ``reward.name: weighted``."""

    parts: list = spec(factory=list, help="[{name: <reward>, weight: <number>, <that reward's keys>...}, ...]")


def _part_problems(parts: Any, key: str) -> tuple[list[Problem], list[tuple[str, float, type | Any, Any]]]:
    """Check every part; return the problems and, for good parts, (name, weight, class, options)."""
    from areal_core.config.load import build
    from areal_core.registry import ComponentError, resolve

    problems: list[Problem] = []
    good: list[tuple[str, float, Any, Any]] = []
    if not isinstance(parts, list) or not parts:
        problems.append(Problem("core.reward-parts", f"{parts!r} is not a non-empty list of parts",
                                f"write {key} as a list like [{{name: math, weight: 1.0}}, {{name: format, weight: 0.1}}]",
                                key))
        return problems, good
    for i, part in enumerate(parts):
        where = f"{key}[{i}]"
        if not isinstance(part, dict) or not isinstance(part.get("name"), str):
            problems.append(Problem("core.reward-parts", f"{part!r} is not a mapping with a 'name'",
                                    f"write {where} as {{name: <reward>, weight: <number>, ...}}", where))
            continue
        options = {k: v for k, v in part.items() if k not in ("name", "weight")}
        weight = part.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append(Problem("core.reward-weight", f"{weight!r} is not a finite number",
                                    f"set {where}.weight to a number such as 1.0", f"{where}.weight"))
        try:
            cls = resolve("reward", part["name"])
        except ComponentError as exc:
            message, _, fix = str(exc).partition(" Fix: ")
            problems.append(Problem("core.component", message, fix.replace("reward.name", f"{where}.name"),
                                    f"{where}.name"))
            continue
        config_class = getattr(cls, "config_class", None)
        found: list[Problem] = []
        if config_class is None:
            found += [Problem("core.unknown-key", f"reward '{part['name']}' takes no options",
                              "remove it", f"{where}.{k}") for k in options]
            built = None
        else:
            built = build(config_class, options, f"{where}.", found)
        found += reward_problems(part["name"], options, where)
        problems += found
        if not found and not any(p.key == f"{where}.weight" for p in problems):
            good.append((part["name"], float(weight), cls, built))
    return problems, good


def reward_problems(name: str, options: dict, key: str = "reward") -> list[Problem]:
    """Problems in the options of the built-in ``function`` and ``weighted`` rewards (others: [])."""
    if name == "function":
        try:
            load_target(options.get("target", ""), f"{key}.target")
        except TargetError as exc:
            return [Problem("core.reward-target", exc.why, exc.fix, exc.key)]
    if name == "weighted":
        return _part_problems(options.get("parts"), f"{key}.parts")[0]
    return []


class WeightedReward(Reward):
    """``reward = sum_i weight_i * reward_i`` over ``parts``, each resolved by name like ``reward.name``.

    Parts are scored concurrently (async ones awaited, sync ones off the
    loop); the result holds each part's reward and extra keys under its
    label (its name, with ``_<index>`` when a name repeats).
    """

    config_class = WeightedConfig

    def __init__(self, context: Context | None = None) -> None:
        super().__init__(context)
        options = self.context.options or WeightedConfig()
        problems, good = _part_problems(options.parts, "reward.parts")
        if problems:
            raise ProblemsError(problems, source="reward.parts")
        names = [name for name, *_ in good]
        self.parts = [
            (name if names.count(name) == 1 else f"{name}_{i}", weight,
             instantiate(cls, Context(config=self.context.config, options=built)))
            for i, (name, weight, cls, built) in enumerate(good)
        ]

    async def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        results = await asyncio.gather(*(call_reward(fn, prompt, completion, item) for _, _, fn in self.parts))
        out: dict[str, Any] = {"reward": sum(w * r.reward for (_, w, _), r in zip(self.parts, results))}
        for (label, weight, _), result in zip(self.parts, results):
            out[label] = result.reward
            out.update({f"{label}.{k}": v for k, v in result.info.items()})
        return out
