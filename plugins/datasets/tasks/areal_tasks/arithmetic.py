"""The ``arithmetic`` task: synthetic arithmetic of graded difficulty, and its verifier.

Two styles:

- ``few_shot`` (raw text, no chat template): ``3+4=7\\n10+5=15\\n8+9=17\\n{a}+{b}=``,
  no stop string unless ``stop_at_newline`` (the completion runs on to
  ``max_new_tokens``, as in TRL's GRPOTrainer); the completion is right when
  it *starts with* the answer. The defaults give exactly this prompt with a, b
  in 0..20.
- ``chat``: one user message asking for the value of a longer expression;
  the completion is right when its final answer (the number after the last
  ``Answer:``, else its last number) equals the value.

Difficulty is graded by ``digits`` (each operand gets 1..digits digits, so a
split mixes easy and hard problems; ``level`` in the item is the largest
operand's digit count), ``operands`` and ``operators``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from areal_core import Problem
from areal_core.api import Reward
from areal_core.config.schema import spec
from areal_tasks.expression import evaluate
from areal_tasks.synthetic import MAX_VALIDATION_SIZE, SyntheticDataset

STYLES = ("few_shot", "chat")
ALLOWED_OPERATORS = ("+", "-", "*")
ISSUE_PREFIX = "3+4=7\n10+5=15\n8+9=17\n"
CHAT_INSTRUCTION = "Compute {expression}. End your reply with 'Answer: ' followed by the number."


@dataclass
class ArithmeticConfig:
    """Keys of ``dataset`` when ``dataset.name: arithmetic``."""

    style: str = spec("few_shot", choices=list(STYLES),
                      help="few_shot: raw prompt '<prefix>{expression}='; chat: a user message")
    operands: int = spec(2, ge=2, le=8, help="numbers per expression")
    operators: list = spec(factory=lambda: ["+"], help="operators drawn between operands, from + - *")
    min_value: int = spec(0, ge=0, help="smallest operand (when digits is 0)")
    max_value: int = spec(20, ge=0, help="largest operand (when digits is 0)")
    digits: int = spec(0, ge=0, le=9,
                       help="> 0: each operand has 1..digits digits, drawn per operand (graded difficulty); "
                            "0: operands in [min_value, max_value]")
    few_shot_prefix: str = spec(ISSUE_PREFIX, help="solved examples before the problem in the few_shot style")
    stop_at_newline: bool = spec(False, help="few_shot: end each completion at its first newline (the answer "
                                             "line); false (default) lets it run on to max_new_tokens, as TRL "
                                             "does: the built-in demo learned clearly so, and plateaued near 0.5 "
                                             "accuracy with answer-line completions")
    instruction: str = spec(CHAT_INSTRUCTION, help="the chat style's user message; {expression} is the problem")
    size: int = spec(0, ge=0, help="train problems; 0 = an endless stream")
    validation_size: int = spec(64, ge=0, le=MAX_VALIDATION_SIZE,
                                help="held-out problems, never in the train split (drawn at the start, by "
                                     "areal check too)")


class ArithmeticDataset(SyntheticDataset):
    """Seeded arithmetic problems (see the module docstring); item keys: id, prompt or messages,
    answer, stop (few_shot), style, expression, level."""

    config_class = ArithmeticConfig
    task = "arithmetic"

    @classmethod
    def option_problems(cls, o: ArithmeticConfig) -> list[Problem]:
        problems = []
        bad = [op for op in o.operators if op not in ALLOWED_OPERATORS]
        if not o.operators or bad:
            problems.append(Problem("tasks.operators", f"{o.operators!r}: each operator must be one of "
                                    f"{', '.join(ALLOWED_OPERATORS)}", "e.g. dataset.operators=['+','-']",
                                    "dataset.operators"))
        if o.digits == 0 and o.min_value > o.max_value:
            problems.append(Problem("tasks.range", f"dataset.min_value ({o.min_value}) is above dataset.max_value "
                                    f"({o.max_value})", "swap them", "dataset.min_value"))
        if o.style == "chat" and "{expression}" not in o.instruction:
            problems.append(Problem("tasks.instruction", f"{o.instruction!r} has no {{expression}} placeholder, so "
                                    f"the problem would not be in the prompt", "add {expression} where it goes",
                                    "dataset.instruction"))
        return problems

    def _operand(self, rng: random.Random) -> int:
        o = self.options
        if o.digits == 0:
            return rng.randint(o.min_value, o.max_value)
        d = rng.randint(1, o.digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)

    def draw(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        o = self.options
        values = [self._operand(rng) for _ in range(o.operands)]
        ops = [rng.choice(o.operators) for _ in range(o.operands - 1)]
        joiner = "" if o.style == "few_shot" else " "
        expression = str(values[0]) + "".join(f"{joiner}{op}{joiner}{v}" for op, v in zip(ops, values[1:]))
        answer = str(int(evaluate(expression).value))
        item: dict[str, Any] = {"answer": answer, "style": o.style, "expression": expression,
                                "level": max(len(str(v)) for v in values)}
        if o.style == "few_shot":
            item["prompt"] = f"{o.few_shot_prefix}{expression}="
            if o.stop_at_newline:
                item["stop"] = ["\n"]
        else:
            item["messages"] = [{"role": "user", "content": o.instruction.format(expression=expression)}]
        return expression, item


INTEGER = re.compile(r"-?\d+")
LEADING_INTEGER = re.compile(r"\s*(-?\d+)")
ANSWER_MARK = re.compile(r"answer\s*[:=]?\s*", re.IGNORECASE)
MAX_ANSWER_DIGITS = 30


def _as_int(text: str | None) -> int | None:
    if text is None or len(text.lstrip("-")) > MAX_ANSWER_DIGITS:
        return None
    return int(text)


def parse_answer(completion: str, style: str) -> int | None:
    """The integer the completion answers, by the style's rule; None when there is none."""
    if style == "few_shot":
        match = LEADING_INTEGER.match(completion)
        return _as_int(match.group(1)) if match else None
    marks = list(ANSWER_MARK.finditer(completion))
    if marks:
        match = INTEGER.match(completion, marks[-1].end())
        if match:
            return _as_int(match.group(0))
    numbers = INTEGER.findall(completion.replace(",", ""))
    return _as_int(numbers[-1]) if numbers else None


class ArithmeticReward(Reward):
    """1.0 when the completion's answer equals ``item["answer"]`` by the item's style, else 0.0.

    ``few_shot``: the completion must start with the number (``"15\\n..."``
    answers 15; ``"152"`` does not). ``chat``: the number after the last
    ``Answer:``, else the last number. Returns ``{"reward", "parsed"}``.
    """

    def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        parsed = parse_answer(completion, item.get("style", "chat"))
        try:
            expected = int(str(item["answer"]).strip())
        except (KeyError, ValueError):
            raise ValueError(f"the arithmetic reward needs an integer item['answer']; item {item.get('id')!r} "
                             f"has {item.get('answer')!r}. Fix: use it with the arithmetic dataset") from None
        return {"reward": float(parsed == expected), "parsed": parsed}
