"""A plugin test double whose reward is fine but whose hook name is misspelt,
so ``areal plugins`` reports its distribution. Installed as a fake
distribution by ``tests/test_conformance_kit.py``; never shipped."""

from __future__ import annotations

from areal_core import hookimpl
from areal_core.api import Reward


class ConstantRewardDouble(Reward):
    def __call__(self, prompt, completion, item):
        return 0.5


@hookimpl
def areal_register_command(registrar):  # misspelt: the hook is areal_register_commands
    return None
