"""The ``exact_match`` reward: 1.0 when the completion's answer equals the item's."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from areal_core.api import Reward

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class ExactMatchConfig:
    """Keys this reward adds to the ``reward`` section of a run config (``reward.case_sensitive``)."""

    case_sensitive: bool = field(default=False, metadata={"help": "compare text answers case-sensitively"})


def as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


class ExactMatchReward(Reward):
    """1.0 if the completion answers ``item["answer"]``, else 0.0.

    A numeric answer is compared with the last number in the completion
    (``"... so 6 times 7 is 42."`` answers ``42``); any other answer with
    the whole completion, stripped, and case-folded unless
    ``case_sensitive``.
    """

    config_class = ExactMatchConfig

    def __call__(self, prompt: str, completion: str, item: Any) -> float:
        options = self.context.options or ExactMatchConfig()
        answer = str(item["answer"]).strip()
        expected = as_number(answer)
        if expected is not None:
            numbers = NUMBER.findall(completion)
            return float(bool(numbers) and as_number(numbers[-1]) == expected)
        got = completion.strip()
        if not options.case_sensitive:
            got, answer = got.casefold(), answer.casefold()
        return float(got == answer)
