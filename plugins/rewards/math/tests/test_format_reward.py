"""The format reward and the check of its keys."""

from __future__ import annotations

import pytest

from areal_core.api import Context
from areal_core.config.validate import validate_run
from areal_core.testing import RewardConformance

from areal_math.format import FormatConfig, FormatReward


class TestFormatReward(RewardConformance):
    component_name = "format"
    examples = [
        ("q", "<think>add them</think> 4", {}, 1.0),
        ("q", "4 <think>late</think>", {}, 0.0),
        ("q", "<think> </think> 4", {}, 0.0),
        ("q", "no tags", {}, 0.0),
    ]


def fmt(**options) -> FormatReward:
    return FormatReward.create(Context(options=FormatConfig(**options)))


def test_required_tags_after_the_think_block():
    reward = fmt(tags=["answer"])
    assert reward("", "<think>2+2</think><answer>4</answer>", {})["reward"] == 1.0
    missing = reward("", "<think>2+2</think> 4", {})
    assert missing["reward"] == 0.0 and missing["missing"] == ["<answer>"]
    # the tag inside the reasoning does not count
    assert reward("", "<think><answer>4</answer></think>", {})["reward"] == 0.0


def test_partial_scores_the_fraction_met():
    reward = fmt(tags=["answer", "check"], partial=True)
    result = reward("", "<think>x</think><answer>4</answer>", {})
    assert result["reward"] == pytest.approx(2 / 3) and result["missing"] == ["<check>"]


def test_no_think_requirement():
    assert fmt(think=False, tags=["answer"])("", "<answer>4</answer>", {})["reward"] == 1.0


def test_bad_tag_names_are_reported_with_key_and_fix():
    with pytest.raises(ValueError, match=r"reward.tags\[1\]: '<b>' is not a tag name"):
        fmt(tags=["answer", "<b>"])
    run = validate_run(overrides=["reward.name=format", "reward.tags=[answer, '<b>']"])
    mine = [p for p in run.problems if p.key.startswith("reward")]
    assert [(p.code, p.key) for p in mine] == [("math.format-tags", "reward.tags[1]")], mine
    assert "tag name" in mine[0].message and "letters" in mine[0].hint
