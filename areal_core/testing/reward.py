"""Conformance suite for rewards (entry-point group ``areal.rewards``)."""

from __future__ import annotations

import asyncio
import math
import traceback
from typing import Any, ClassVar

import pytest

from areal_core.api.reward import RewardResult, call_reward, normalize_result
from areal_core.testing.base import ComponentConformance

# Text a model may well produce: control bytes, odd unicode, huge and
# non-finite numbers, unbalanced markup, and a lot of it.
GARBAGE_COMPLETION = ("\x00\x07 }}{{ \\boxed{ 1e309 nan -inf 0x1F ½ ⅞ 𝟘 \u202e <|endoftext|> ```python\n"
                      "def f(:\n``` \\frac{1}{0} NaN 9" * 400)


class RewardConformance(ComponentConformance):
    """Checks a reward: what it returns, that it survives any text, that it is deterministic.

    Set on the subclass: ``component_name``; ``examples``, a list of
    ``(prompt, completion, item, expected_reward)`` the reward must score as
    given (strongly recommended: without them the values go unchecked and
    :meth:`test_examples_score_as_expected` is skipped); optionally
    ``sample_item``, the item used for the edge cases (default: the first
    example's item, else ``{}``).
    """

    kind: ClassVar[str] = "reward"
    examples: ClassVar[list[tuple[str, str, Any, float]]] = []
    sample_item: ClassVar[Any] = None

    # -- helpers ------------------------------------------------------------
    def reward(self) -> Any:
        return self.make(self.component_class())

    def sample(self) -> tuple[str, Any]:
        """(prompt, item) for the edge cases."""
        if self.sample_item is not None:
            prompt = self.examples[0][0] if self.examples else "What is 6 times 7?"
            return prompt, self.sample_item
        if self.examples:
            return self.examples[0][0], self.examples[0][2]
        return "What is 6 times 7?", {}

    def score(self, reward: Any, prompt: str, completion: str, item: Any, what: str) -> RewardResult:
        """The reward's result through :func:`call_reward`, as the rollout controller gets it."""
        try:
            return asyncio.run(call_reward(reward, prompt, completion, item))
        except Exception as exc:
            if traceback.extract_tb(exc.__traceback__)[-1].name == normalize_result.__name__:
                pytest.fail(f"{self.component_name} on {what}: {exc}")  # a bad return value
            pytest.fail(f"{self.component_name} raised {type(exc).__name__}: {exc} on {what}; a reward "
                        f"must score any text the model produces (0.0 when it cannot be parsed)")

    # -- tests --------------------------------------------------------------
    def test_returns_a_finite_float_or_a_dict_with_reward(self) -> None:
        prompt, item = self.sample()
        completion = self.examples[0][1] if self.examples else "The answer is 42."
        result = self.score(self.reward(), prompt, completion, item, f"completion {completion!r}")
        assert math.isfinite(result.reward)

    def test_empty_completion_does_not_raise(self) -> None:
        prompt, item = self.sample()
        self.score(self.reward(), prompt, "", item, "an empty completion")

    def test_long_garbage_completion_does_not_raise(self) -> None:
        prompt, item = self.sample()
        self.score(self.reward(), prompt, GARBAGE_COMPLETION, item,
                   f"a {len(GARBAGE_COMPLETION)}-character garbage completion")

    def test_examples_score_as_expected(self) -> None:
        if not self.examples:
            pytest.skip(f"{type(self).__name__}.examples is empty: add (prompt, completion, item, "
                        f"expected_reward) tuples to check the values {self.component_name} gives")
        reward = self.reward()
        wrong = []
        for prompt, completion, item, expected in self.examples:
            got = self.score(reward, prompt, completion, item, f"completion {completion!r}").reward
            if not math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6):
                wrong.append(f"  completion {completion!r}, item {item!r}: expected {expected}, got {got}")
        assert not wrong, f"{self.component_name} scored examples differently:\n" + "\n".join(wrong)

    def test_is_deterministic(self) -> None:
        prompt, item = self.sample()
        cases = [(p, c, i) for p, c, i, _ in self.examples] or [(prompt, "The answer is 42.", item)]
        reward = self.reward()
        for case_prompt, completion, case_item in cases:
            what = f"completion {completion!r}"
            first = self.score(reward, case_prompt, completion, case_item, what)
            second = self.score(reward, case_prompt, completion, case_item, what)
            assert first.reward == second.reward, (
                f"{self.component_name} scored {what} {first.reward} then {second.reward}; a reward "
                f"must be deterministic (seed any randomness from the item)")
