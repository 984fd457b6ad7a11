"""The ``math`` reward: 1.0 when the completion's final answer equals ``item[answer_key]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_core.api import Reward
from areal_core.config.schema import spec

from areal_math.extract import extract_answer, nesting_depth
from areal_math.verify import equivalent


@dataclass
class MathConfig:
    """Keys of the ``reward`` section when ``reward.name: math``."""

    answer_key: str = spec("answer", help="item field holding the reference answer (a string)")
    timeout_s: float = spec(5.0, gt=0.0, help="hard bound on one comparison; past it the worker is killed and the reward is 0")
    workers: int = spec(2, ge=1, help="math-verify worker processes (shared by every math reward with this count)")
    max_answer_chars: int = spec(1000, ge=1, help="longer extracted answers score 0 without being parsed")
    max_answer_depth: int = spec(10, ge=1, help="answers nested deeper in (), [] or {} score 0 without being "
                                 "parsed (sympy's parse time grows steeply with depth: a verdict that depended on "
                                 "the machine's load)")


class MathReward(Reward):
    """Extract the final answer (``\\boxed{}``, ``####``, "the answer is", the last number the prose does not
    reject) and compare it with the reference through math-verify.

    Returns ``{"reward": 1.0 | 0.0, "extracted": str | None, "method": str | None,
    "reason": str}``; ``reason`` is one of ``correct``, ``wrong``, ``no_answer``,
    ``missing_reference``, ``ambiguous_answer``, ``answer_too_long``, ``answer_too_deep``, ``unparsable_answer``,
    ``unparsable_reference``, ``timeout``, ``error``. Never raises on any
    completion or item.
    """

    config_class = MathConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.options: MathConfig = self.context.options or MathConfig()

    def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        key = self.options.answer_key
        reference = item.get(key) if isinstance(item, dict) else None
        if reference is None or not str(reference).strip():
            return _result(None, None, "missing_reference",
                           f"item has no {key!r} (set reward.answer_key to the field holding the answer)")
        found = extract_answer(completion)
        if found is None:
            return _result(None, None, "no_answer", "no boxed answer, '####', 'the answer is' or number found")
        if found.method == "ambiguous":
            return _result(found.answer, found.method, "ambiguous_answer", "the last number is one of alternatives "
                           "('7 or 8'); no boxed or stated answer picks one")
        if len(found.answer) > self.options.max_answer_chars:
            return _result(found.answer[:80] + "...", found.method, "answer_too_long",
                           f"{len(found.answer)} characters > reward.max_answer_chars={self.options.max_answer_chars}")
        depth = nesting_depth(found.answer)
        if depth > self.options.max_answer_depth:
            return _result(found.answer[:80], found.method, "answer_too_deep",
                           f"nested {depth} deep > reward.max_answer_depth={self.options.max_answer_depth}")
        reference = str(reference).strip()
        if found.answer == reference:  # the common case needs no worker
            return _result(found.answer, found.method, "correct", "identical text", 1.0)
        verdict = equivalent(reference, found.answer, self.options.timeout_s, self.options.workers)
        return _result(found.answer, found.method, verdict.reason, verdict.detail, float(verdict.equal))


def _result(extracted: str | None, method: str | None, reason: str, detail: str, reward: float = 0.0) -> dict:
    return {"reward": reward, "extracted": extracted, "method": method, "reason": reason, "detail": detail}
