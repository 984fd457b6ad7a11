"""The reward contract: ``(prompt, completion, item) -> float | dict``, sync or async.

A reward is any callable with that shape: a function, a class instance, or a
class (entry-point group ``areal.rewards``) whose instances are such
callables. A dict result must hold a float under ``"reward"``; other keys are
logged. Slow or unsafe rewards run outside the event loop (see
:func:`call_reward`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from areal_core.api.component import Component


@dataclass(frozen=True)
class RewardResult:
    reward: float
    info: dict = field(default_factory=dict)


class Reward(Component):
    """Base class for rewards shipped as classes; override ``__call__`` (sync or async)."""

    def __call__(self, prompt: str, completion: str, item: Any) -> float | dict:  # pragma: no cover
        raise NotImplementedError


def normalize_result(value: Any, who: str) -> RewardResult:
    """Check a reward's return value and turn it into a :class:`RewardResult`."""
    info: dict = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"reward {who} returned a dict without a 'reward' key: {sorted(value)}")
        info = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward {who} returned {value!r}; a reward returns a float or a dict with 'reward'")
    if not math.isfinite(value):
        raise ValueError(f"reward {who} returned {value}; rewards must be finite")
    return RewardResult(float(value), info)


async def call_reward(fn: Any, prompt: str, completion: str, item: Any,
                      executor: Executor | None = None) -> RewardResult:
    """Await an async reward, or run a sync one in ``executor`` (the loop's default if None)."""
    who = getattr(fn, "__qualname__", type(fn).__name__)
    target = fn.__call__ if not inspect.isroutine(fn) and callable(fn) else fn
    if inspect.iscoroutinefunction(target):
        value = await fn(prompt, completion, item)
    else:
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(executor, fn, prompt, completion, item)
    return normalize_result(value, who)
