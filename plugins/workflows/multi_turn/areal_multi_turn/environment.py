"""What the model talks to between its turns, and the default one: retry with feedback.

An environment is named in config (``workflow.environment: "my_pkg.env:Calculator"``):

- a class: built once per episode as ``cls(item=item, reward=reward, **workflow.environment_options)``;
  its ``step(completion, turn)`` (sync or async) answers each model turn;
- a function: called as ``fn(item, completion, turn)`` (sync or async) for each model turn.

Either returns a :class:`Reply` (or a dict of its fields). ``turn`` counts from 1.
A sync step runs in the event loop's default executor (a thread), as a sync
reward does: a slow tool or verifier must not stall every other episode on
the rollout loop.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from areal_core.api import call_reward


@dataclass
class Reply:
    """The environment's answer to one model turn.

    ``reward``: the episode's reward if it ended now; ``done``: end the
    episode (success, or nothing more to say); ``message``: text sent back as
    a turn of ``role`` (``"user"`` feedback, ``"tool"`` output); ``info``:
    logged with the trajectory.
    """

    reward: float
    done: bool
    message: str = ""
    role: str = "user"
    info: dict = field(default_factory=dict)


class RetryWithFeedback:
    """Scores each answer with the run's reward; below ``success_threshold`` it asks again.

    The default environment: a wrong answer gets ``feedback`` ("That is not
    right. Try again.") as a user turn; a right one ends the episode.
    """

    def __init__(self, item: Any, reward: Any, feedback: str = "That is not right. Try again.",
                 success_threshold: float = 1.0) -> None:
        self.item, self.reward = item, reward
        self.feedback, self.success_threshold = feedback, success_threshold
        self.prompt = ""

    async def step(self, completion: str, turn: int) -> Reply:
        result = await call_reward(self.reward, self.prompt, completion, self.item)
        if result.reward >= self.success_threshold:
            return Reply(result.reward, True, info=result.info)
        return Reply(result.reward, False, self.feedback, "user", result.info)


def load_object(reference: str, key: str) -> Any:
    """The object ``"package.module:attribute"`` names; errors name the config key and the fix."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{key} is {reference!r}; write it as 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key} is {reference!r} but module {module_name!r} cannot be imported "
                         f"({type(exc).__name__}: {exc}). Fix: install it or correct the name") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"{key} is {reference!r} but {module_name} has no {attribute!r}. "
                         f"Fix: correct the name after ':'") from None


class FunctionEnvironment:
    """Adapts a plain function ``fn(item, completion, turn)`` (sync or async) to the class protocol."""

    def __init__(self, fn: Any, item: Any) -> None:
        self.fn, self.item = fn, item
        self.is_async = _is_async(fn)

    def step(self, completion: str, turn: int) -> Any:
        return self.fn(self.item, completion, turn)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def answer(environment: Any, completion: str, turn: int) -> Reply:
    """Call ``environment.step`` (awaited when async, in a thread when sync) and check what it returned."""
    is_async = getattr(environment, "is_async", None)
    if is_async is None:
        is_async = _is_async(environment.step)
    if is_async:
        value = await environment.step(completion, turn)
    else:
        value = await asyncio.get_running_loop().run_in_executor(None, environment.step, completion, turn)
        if inspect.isawaitable(value):  # a plain ``def step`` that hands back a coroutine
            value = await value
    if isinstance(value, dict):
        value = Reply(**value)
    if not isinstance(value, Reply):
        raise TypeError(f"environment {type(environment).__name__} returned {value!r}; return a Reply "
                        f"(or a dict with reward, done and optionally message, role, info)")
    return value
