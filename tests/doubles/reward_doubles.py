"""Reward test doubles for the conformance kit's own tests: one good, the rest
each breaking one rule. Installed as a fake distribution by
``tests/test_conformance_kit.py``; never shipped."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from areal_core.api import Reward


@dataclass
class ToyRewardDoubleConfig:
    scale: float = field(default=1.0, metadata={"help": "the reward when the answer occurs in the completion"})


class ToyRewardDouble(Reward):
    """``scale`` when the item's answer occurs in the completion, else 0."""

    config_class = ToyRewardDoubleConfig

    def __call__(self, prompt, completion, item):
        return self.context.options.scale if str(item.get("answer")) in completion else 0.0


async def async_dict_reward_double(prompt, completion, item):
    """A plain async function returning a dict: also a valid reward."""
    return {"reward": float(completion.strip() == str(item.get("answer"))), "length": len(completion)}


class StringRewardDouble(Reward):
    """Broken: returns the reward as text."""

    def __call__(self, prompt, completion, item):
        return "1.0"


class EmptyCrashRewardDouble(Reward):
    """Broken: takes the last word without checking there is one."""

    def __call__(self, prompt, completion, item):
        return float(completion.split()[-1] == str(item.get("answer")))


class RandomRewardDouble(Reward):
    """Broken: not deterministic."""

    def __call__(self, prompt, completion, item):
        return random.random()


class OffByOneRewardDouble(Reward):
    """Broken: well-formed values, but wrong ones."""

    def __call__(self, prompt, completion, item):
        return 1.0 - float(str(item.get("answer")) in completion)


@dataclass
class NoDefaultConfigDouble:
    threshold: float


class NoDefaultConfigRewardDouble(Reward):
    """Broken: its config_class has a field without a default."""

    config_class = NoDefaultConfigDouble

    def __call__(self, prompt, completion, item):
        return 0.0
