"""The ``countdown`` task: reach a target from given numbers with + - * /, and its verifier.

Every problem is solvable by construction: the generator combines a subset
of the drawn numbers (all of them with ``use_all``) into a random expression
whose intermediate results are positive whole numbers, and the target is its
value. The verifier parses the model's expression with :mod:`ast` (nothing
is executed), checks each number is one of those given and used at most as
often as given, and compares the exact value with the target.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from areal_core import Problem
from areal_core.api import Reward
from areal_core.config.schema import spec
from areal_tasks.expression import ExpressionError, evaluate
from areal_tasks.synthetic import MAX_VALIDATION_SIZE, SyntheticDataset

MAX_TRIES = 1000
PROMPT = ("Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
          "You may use + - * / and parentheses, and each number at most once{rules}. "
          "Put the expression alone inside <answer></answer>, for example <answer>(1 + 2) * 3</answer>.")


@dataclass
class CountdownConfig:
    """Keys of ``dataset`` when ``dataset.name: countdown``."""

    count: int = spec(4, ge=2, le=6, help="numbers given per problem")
    min_number: int = spec(1, ge=1, help="smallest number given")
    max_number: int = spec(25, ge=1, help="largest number given (at least min_number)")
    min_target: int = spec(10, ge=1, help="smallest target")
    max_target: int = spec(100, ge=1, help="largest target (at least min_target)")
    use_all: bool = spec(False, help="the answer must use every number (each exactly once)")
    exact_division: bool = spec(True, help="every division must leave no remainder")
    size: int = spec(0, ge=0, help="train problems; 0 = an endless stream")
    validation_size: int = spec(64, ge=0, le=MAX_VALIDATION_SIZE,
                                help="held-out problems, never in the train split (drawn at the start, by "
                                     "areal check too)")


class CountdownDataset(SyntheticDataset):
    """Seeded countdown problems; item keys: id, messages, answer (one solution), numbers, target,
    use_all, exact_division."""

    config_class = CountdownConfig
    task = "countdown"

    @classmethod
    def option_problems(cls, o: CountdownConfig) -> list[Problem]:
        return [Problem("tasks.range", f"dataset.{low} ({getattr(o, low)}) is above dataset.{high} "
                        f"({getattr(o, high)})", "swap them", f"dataset.{low}")
                for low, high in (("min_number", "max_number"), ("min_target", "max_target"))
                if getattr(o, low) > getattr(o, high)]

    def draw(self, rng: random.Random) -> tuple[tuple, dict[str, Any]]:
        o = self.options
        for _ in range(MAX_TRIES):
            numbers = [rng.randint(o.min_number, o.max_number) for _ in range(o.count)]
            used = numbers if o.use_all else rng.sample(numbers, rng.randint(2, o.count))
            solution = _combine([(str(n), n) for n in used], rng)
            if solution is None:
                continue
            text, target = solution
            if o.min_target <= target <= o.max_target and target not in numbers:
                break
        else:
            raise ValueError(
                f"countdown: no problem with a target in [{o.min_target}, {o.max_target}] found in {MAX_TRIES} "
                f"tries from numbers in [{o.min_number}, {o.max_number}]. Fix: widen dataset.min_target / "
                f"dataset.max_target or the numbers' range")
        rules = (", and every number exactly once" if o.use_all else "") + \
                ("; every division must be exact" if o.exact_division else "")
        shown = ", ".join(map(str, numbers))
        item = {"messages": [{"role": "user", "content": PROMPT.format(numbers=shown, target=target, rules=rules)}],
                "answer": text, "numbers": numbers, "target": target, "use_all": o.use_all,
                "exact_division": o.exact_division}
        return (tuple(sorted(numbers)), target), item


def _combine(terms: list[tuple[str, int]], rng: random.Random) -> tuple[str, int] | None:
    """Join the terms pairwise at random into one expression whose every step is a positive whole number."""
    terms = list(terms)
    while len(terms) > 1:
        (a_text, a), (b_text, b) = terms.pop(rng.randrange(len(terms))), terms.pop(rng.randrange(len(terms)))
        if a < b:
            (a_text, a), (b_text, b) = (b_text, b), (a_text, a)
        choices = [("+", a + b), ("*", a * b)]
        if a > b:
            choices.append(("-", a - b))
        if b > 1 and a % b == 0:
            choices.append(("/", a // b))
        op, value = rng.choice(choices)
        terms.append((f"({a_text} {op} {b_text})" if len(terms) else f"{a_text} {op} {b_text}", value))
    return terms[0] if terms[0][1] > 0 else None


TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@dataclass
class CountdownRewardConfig:
    """Keys of ``reward`` when ``reward.name: countdown``."""

    format_reward: float = spec(0.0, ge=0.0, le=1.0,
                                help="reward for a valid expression of the given numbers that misses the target")


def extract_expression(completion: str) -> str | None:
    """The text inside the last <answer></answer>, without a trailing '= target'; None when there is none."""
    tags = TAG.findall(completion)
    if not tags:
        return None
    expression = tags[-1].strip()
    if "=" in expression:  # "3 * 4 = 12": the left side is the expression
        expression = expression.split("=", 1)[0]
    return expression.strip().rstrip(".")


def check(expression: str, item: Any) -> tuple[bool, bool, str]:
    """(valid, reaches the target, reason) for ``expression`` under the item's rules."""
    try:
        result = evaluate(expression)
    except ExpressionError as exc:
        return False, False, str(exc)
    given, used = Counter(int(n) for n in item["numbers"]), Counter(result.numbers)
    unknown = sorted(set(used) - set(given))
    if unknown:
        return False, False, f"uses {', '.join(map(str, unknown))}, not among the given numbers"
    reused = sorted(n for n in used if used[n] > given[n])
    if reused:
        return False, False, f"uses {', '.join(map(str, reused))} more often than given"
    if item.get("use_all", False) and used != given:
        return False, False, "does not use every number"
    if item.get("exact_division", True) and result.inexact_division:
        return False, False, "a division leaves a remainder"
    hit = result.value == int(item["target"])
    return True, hit, "reaches the target" if hit else f"equals {result.value}, not {item['target']}"


class CountdownReward(Reward):
    """1.0 when the expression in the last <answer></answer> is allowed and equals the target.

    ``format_reward`` (default 0) for an allowed expression that misses;
    0.0 otherwise. Returns ``{"reward", "reason"}``.
    """

    config_class = CountdownRewardConfig

    def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        options = self.context.options or CountdownRewardConfig()
        expression = extract_expression(completion)
        if expression is None:
            return {"reward": 0.0, "reason": "no <answer></answer>"}
        valid, hit, reason = check(expression, item)
        return {"reward": 1.0 if hit else (options.format_reward if valid else 0.0), "reason": reason}
