"""``weighted`` (areal-core) combining this plugin's math and format rewards by name."""

from __future__ import annotations

import asyncio

import pytest

from areal_core.config.validate import validate_run
from areal_core.trainer import build
from areal_core.api import call_reward

PARTS = "reward.parts=[{name: math, weight: 1.0}, {name: format, weight: 0.5, tags: [answer]}]"


def weighted():
    run = validate_run(overrides=["reward.name=weighted", PARTS])
    assert not [p for p in run.problems if p.key.startswith("reward")], run.problems
    return build(run, "reward")


@pytest.mark.parametrize(("completion", "expected", "math", "fmt"), [
    ("<think>2+2</think><answer>\\boxed{4}</answer>", 1.5, 1.0, 1.0),
    ("<think>2+2</think><answer>\\boxed{5}</answer>", 0.5, 0.0, 1.0),
    ("\\boxed{4}", 1.0, 1.0, 0.0),
    ("nothing", 0.0, 0.0, 0.0),
])
def test_weighted_sum_of_math_and_format(completion, expected, math, fmt):
    result = asyncio.run(call_reward(weighted(), "2+2?", completion, {"answer": "4"}))
    assert result.reward == pytest.approx(expected)
    assert (result.info["math"], result.info["format"]) == (math, fmt)
    assert "math.reason" in result.info and "format.missing" in result.info


def test_part_options_are_checked_with_their_keys():
    run = validate_run(overrides=["reward.name=weighted",
                                  "reward.parts=[{name: math, timeout_s: -1}, {name: formt}, {name: format, weight: x}]"])
    keys = sorted(p.key for p in run.problems if p.key.startswith("reward"))
    assert keys == ["reward.parts[0].timeout_s", "reward.parts[1].name", "reward.parts[2].weight"], run.problems
    named = next(p for p in run.problems if p.key == "reward.parts[1].name")
    assert "Did you mean 'format'" in named.message
