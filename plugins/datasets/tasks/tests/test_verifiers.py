"""The arithmetic and countdown rewards on hand-made cases, and the reward conformance kit."""

from __future__ import annotations

import asyncio

import pytest

from areal_core.api import call_reward
from areal_core.testing import RewardConformance
from areal_tasks.countdown import CountdownReward, check, extract_expression
from areal_tasks.expression import ExpressionError, evaluate

FEW = {"id": "a", "answer": "15", "style": "few_shot"}
CHAT = {"id": "b", "answer": "-1194", "style": "chat"}
CD = {"id": "c", "numbers": [3, 7, 25, 50], "target": 83, "use_all": False, "exact_division": True, "answer": ""}


class TestArithmeticReward(RewardConformance):
    component_name = "arithmetic"
    examples = [
        ("10+5=", "15\n3+3=6", FEW, 1.0),
        ("10+5=", " 15", FEW, 1.0),
        ("10+5=", "152", FEW, 0.0),  # starts with 15 but says 152
        ("10+5=", "1\n15", FEW, 0.0),  # the sum later does not count
        ("10+5=", "", FEW, 0.0),
        ("Compute 8 - 528 - 674.", "8-528 = -520, -520-674 = -1194. Answer: -1194", CHAT, 1.0),
        ("Compute 8 - 528 - 674.", "Answer: -1194. Checking: 1194 is big", CHAT, 1.0),
        ("Compute 8 - 528 - 674.", "It is -1194, or maybe 1194", CHAT, 0.0),
        ("Compute 8 - 528 - 674.", "-1,194", CHAT, 1.0),
    ]


class TestCountdownReward(RewardConformance):
    component_name = "countdown"
    examples = [
        ("p", "<answer>50 + 25 + 7 + 3 - 2</answer>", CD, 0.0),  # 2 is not given
        ("p", "<answer>50 + 25 + 7 + 1</answer>", CD, 0.0),
        ("p", "think... <answer>wrong</answer> then <answer>(50 + 25) + 7 + 3 - 2</answer>", CD, 0.0),
        ("p", "<answer>50 + 25 + 7</answer>", CD, 0.0),  # 82
        ("p", "<answer>50 + 3 * 7 + 25 - 3 * 3 - 4</answer>", CD, 0.0),  # 3 used three times
        ("p", "<answer>50 + 25 + 3 + 7 - 2 * 1</answer>", CD, 0.0),
        ("p", "<answer>(50 + 25) + (3 + 7) - 2</answer>", CD, 0.0),
        ("p", "I think <answer>50 + 3*7 + 25 - 3 - 10</answer>", CD, 0.0),
        ("p", "<answer>50 + 25 + 3 + 7 = 85</answer>", CD, 0.0),
        ("p", "<answer>(50 + 25 + 7) + 3 / 3</answer>", CD, 0.0),  # 3 twice
        ("p", "<answer>50 + 25 + 7 + 3 / 3</answer>", {**CD, "numbers": [3, 3, 7, 25, 50]}, 1.0),
        ("p", "<answer>50 + 7 * 3 + 25 - 13</answer>", CD, 0.0),  # 13 not given
        ("p", "<answer>50 + 25 + 7 * 3 / 3</answer>", CD, 0.0),
        ("p", "<answer> 25 * 3 + 50 / 7 </answer>", {**CD, "target": 82}, 0.0),  # 50/7 not exact
        ("p", "<answer>3 * 25 + 7 + 50 - 50</answer>", CD, 0.0),  # 50 twice
        ("p", "Sure. <answer>3 * 25 + 7 + 50 / 50</answer>", {**CD, "numbers": [3, 7, 25, 50, 50]}, 1.0),
        ("p", "<answer>25 * 3 + 7 + 50 / 50</answer>", CD, 0.0),
        ("p", "<answer>(25 * 3) + 7 + (50 - 50) + 1</answer>", CD, 0.0),
        ("p", "<answer>25*3 + 7 + 50/50</answer>", {**CD, "numbers": [25, 3, 7, 50, 50]}, 1.0),
        ("p", "<answer>3 * 25 + 7 + 1</answer>", CD, 0.0),
        ("p", "<answer>50 + 3 * 7 + 25 - 13</answer>", CD, 0.0),
        ("p", "no tags: 50 + 25 + 7 + 1", CD, 0.0),
        ("p", "<answer>25 * 3 + 7 + 1</answer>", {**CD, "numbers": [25, 3, 7, 1]}, 1.0),
    ]


def score(completion, item, **options):
    from areal_core.api import Context
    from areal_tasks.countdown import CountdownRewardConfig

    reward = CountdownReward(Context(options=CountdownRewardConfig(**options)))
    return asyncio.run(call_reward(reward, "p", completion, item))


def test_countdown_reasons_for_each_rule():
    item = {**CD, "numbers": [25, 3, 7, 1]}
    assert score("<answer>25 * 3 + 7 + 1</answer>", item).info["reason"] == "reaches the target"
    assert score("<answer>25 * 3 + 7 + 7</answer>", item).info["reason"] == "uses 7 more often than given"
    assert score("<answer>25 * 3 + 8</answer>", item).info["reason"] == "uses 8, not among the given numbers"
    assert score("<answer>25 * 3 + 7</answer>", item).info["reason"] == "equals 82, not 83"
    assert score("<answer>25 * 3 + 7</answer>", item, format_reward=0.1).reward == pytest.approx(0.1)
    assert score("<answer>25 * 3 + 7</answer>", {**item, "use_all": True}).info["reason"] == \
        "does not use every number"
    # 7 / 3 is not exact: refused when the item says so, allowed otherwise
    inexact = {**CD, "numbers": [7, 3, 83], "target": 83}
    assert score("<answer>83 + 7 / 3 - 7 / 3</answer>", inexact).info["reason"] == \
        "uses 3, 7 more often than given"
    assert check("25 * (7 / 3)", {**CD, "numbers": [25, 7, 3], "target": 58})[2] == "a division leaves a remainder"
    assert check("25 * (7 / 3)", {**CD, "numbers": [25, 7, 3], "target": 58, "exact_division": False})[0]


@pytest.mark.parametrize("attack", [
    "__import__('os').system('touch /tmp/areal-pwned')",
    "(lambda: 1)()",
    "open('/etc/passwd').read()",
    "[x for x in (1, 2)]",
    "9 ** 9 ** 9",
    "3; import os",
    "a + 3",
    "-3 + 50",
    "3.5 * 2",
    "True + 3",
    "'3' + '7'",
    "(" * 500 + "3" + ")" * 500,
    "9" * 50,
])
def test_countdown_refuses_anything_but_arithmetic_of_whole_numbers(attack, tmp_path):
    with pytest.raises(ExpressionError):
        evaluate(attack)
    result = score(f"<answer>{attack}</answer>", CD)
    assert result.reward == 0.0 and result.info["reason"]


def test_expression_extraction_takes_the_last_tag_and_drops_the_target():
    assert extract_expression("<answer>1</answer> x <answer> 3 * 4 = 12. </answer>") == "3 * 4"
    assert extract_expression("3 * 4") is None
    assert evaluate("(3 + 7) × 5 ÷ 2").value == 25
