"""The math reward: extraction, equivalence through math-verify, timeouts, threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from areal_core.api import Context, call_reward
from areal_core.testing import RewardConformance, scaled, wait_until

from areal_math.extract import extract_answer
from areal_math.reward import MathConfig, MathReward


class TestMathReward(RewardConformance):
    component_name = "math"
    examples = [
        ("2+2?", "Adding, we get \\boxed{4}.", {"answer": "4"}, 1.0),
        ("Half?", "So it is \\boxed{\\dfrac{1}{2}}", {"answer": "0.5"}, 1.0),
        ("Eggs?", "She sells 16 - 3 - 4 = 9 eggs.\n#### 9", {"answer": "9"}, 1.0),
        ("Eggs?", "The answer is 10.", {"answer": "9"}, 0.0),
        ("Pay?", "She earns 9 * 2 = 18. The answer is 18 dollars.", {"answer": "18"}, 1.0),
        ("Eggs?", "I cannot tell.", {"answer": "9"}, 0.0),
    ]


def score(completion: str, answer: str, **options) -> dict:
    reward = MathReward.create(Context(options=MathConfig(**options)))
    return reward("", completion, {"answer": answer})


@pytest.fixture
def scheduled(monkeypatch) -> list:
    """The futures of the comparisons put on the math-verify pools (the real pools), in the order they were put
    there: a test waits on them for a comparison to be queued or running in a worker."""
    from areal_math import verify

    futures: list = []
    real_pool = verify.pool

    class NotingPool:
        def __init__(self, inner) -> None:
            self.inner = inner

        def schedule(self, *args, **kwargs):
            future = self.inner.schedule(*args, **kwargs)
            futures.append(future)
            return future

    monkeypatch.setattr(verify, "pool", lambda workers: NotingPool(real_pool(workers)))
    return futures


# (reference, model's answer): equal by math-verify
EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "0.5"),
    ("\\frac{1}{2}", "\\dfrac{1}{2}"),
    ("0.5", "50\\%"),               # percent counts: 50% is 0.5
    ("3", "x=3"),
    ("1234", "1,234"),              # thousands separator
    ("5", "5\\text{ cm}"),          # units dropped
    ("-7", "-7.0"),
    ("\\{1,2\\}", "\\{2,1\\}"),     # sets
    ("[1,2)", "[1,2)"),             # intervals
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("2x+2", "2(x+1)"),             # expressions
    ("12.5", "12.50"),
    ("12", "\\$12"),
    ("0.333", "0.333"),             # a rounded decimal counts when the reference is that decimal
    ("\\frac{1}{8}", "0.125"),      # an exact decimal is the fraction
]

NOT_EQUIVALENT = [
    ("3", "-3"),                    # sign
    ("0.333", "\\frac{1}{3}"),      # a rounded decimal is not the fraction
    ("1/3", "0.3333333"),           # ... however many places (math-verify's default, 6 places, says equal)
    ("2.5", "2.4999999"),
    ("\\frac{2}{3}", "0.666667"),
    ("(1,2]", "[1,2]"),             # open vs closed interval
    ("2x+2", "2x+1"),
    ("1234", "1,235"),
    ("\\{1,2\\}", "\\{1,3\\}"),
]


@pytest.mark.parametrize(("reference", "answer"), EQUIVALENT)
def test_equivalent_answers_score_one(reference, answer):
    result = score(f"Therefore the result is \\boxed{{{answer}}}.", reference)
    assert result["reward"] == 1.0, result
    assert result["reason"] == "correct" and result["extracted"] == answer


@pytest.mark.parametrize(("reference", "answer"), NOT_EQUIVALENT)
def test_different_answers_score_zero(reference, answer):
    result = score(f"\\boxed{{{answer}}}", reference)
    assert result["reward"] == 0.0, result
    assert result["reason"] == "wrong"


@pytest.mark.parametrize(("completion", "answer", "method"), [
    ("first \\boxed{1} then \\boxed{\\frac{2}{3}} done", "\\frac{2}{3}", "boxed"),
    ("nested \\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}", "boxed"),
    ("Janet has 16 - 3 = 13 eggs left.\n#### 1,300", "1,300", "gsm8k"),
    ("Thinking... 7 then 8. The answer is $\\frac{3}{4}$.", "\\frac{3}{4}", "answer_is"),
    ("Final answer: -12", "-12", "answer_is"),
    ("It costs 3 dollars, so 4 items cost 12.", "12", "last_number"),
    ("about -1,234.5 units", "-1,234.5", "last_number"),
    # a unit after the number is dropped (math-verify would read "dollars" as symbols times 18) ...
    ("Each costs 4, so the answer is 18 dollars.", "18", "answer_is"),
    ("#### 1,300 eggs", "1,300", "gsm8k"),
    ("The answer is 3/4 of a cup.", "3/4", "answer_is"),
    # ... but not a symbol, and not when more numbers follow
    ("The answer is 2 pi.", "2 pi", "answer_is"),
    ("The answer is 7 apples and 2 pears.", "7 apples and 2 pears", "answer_is"),
])
def test_extraction_rules(completion, answer, method):
    found = extract_answer(completion)
    assert found is not None and (found.answer, found.method) == (answer, method)


@pytest.mark.parametrize(("completion", "answer"), [
    ("The result is 7, not 8.", "7"),
    ("The answer is 7, not 8.", "7"),
    ("The answer is 7 rather than 8", "7"),
    ("#### 12, not 13", "12"),
    ("It is not 8. It is 7.", "7"),
    ("So 3+4=7", "7"),
])
def test_a_number_the_prose_rejects_is_not_the_answer(completion, answer):
    """An answer stated with a rejected candidate ("7, not 8") is scored on the one it keeps, by every rule."""
    assert score(completion, answer)["reward"] == 1.0
    wrong = str(int(answer) + 1)
    assert score(completion, wrong)["reward"] == 0.0


def test_alternatives_without_a_choice_score_zero():
    for completion in ("It is 7 or 8.", "Either 7 or 8"):
        result = score(completion, "8")
        assert result == {**result, "reward": 0.0, "reason": "ambiguous_answer", "method": "ambiguous"}, result
    assert score("It is 7 or 8. I pick 8.", "8")["reward"] == 1.0  # a later sentence picks one
    assert score("It isn't 8", "8")["reason"] == "no_answer"
    assert score("The result is \\boxed{7}, not 8.", "7")["reward"] == 1.0  # rule 1 first: box the answer


def test_a_deeply_nested_answer_scores_zero_at_once_whatever_the_load():
    """The depth cap decides before math-verify: the same verdict on an idle and a loaded machine (23 nested
    parentheses took about 5 s to parse, near the timeout, so the verdict had depended on load)."""
    deep = "(" * 23 + "8" + ")" * 23
    began = time.monotonic()
    result = score(f"\\boxed{{{deep}}}", "8", timeout_s=60.0)
    assert result["reason"] == "answer_too_deep" and result["reward"] == 0.0, result
    assert "nested 23 deep > reward.max_answer_depth=10" in result["detail"]
    assert time.monotonic() - began < 1.0  # no worker was asked
    assert score("\\boxed{" + "(" * 10 + "8" + ")" * 10 + "}", "8", timeout_s=60.0)["reward"] == 1.0


def test_nothing_to_extract():
    assert extract_answer("no digits here, and \\boxed{ unclosed") is None
    result = score("I do not know", "4")
    assert result == {**result, "reward": 0.0, "reason": "no_answer", "extracted": None}


def test_missing_or_renamed_reference():
    reward = MathReward.create(Context(options=MathConfig()))
    assert reward("", "\\boxed{4}", {"solution": "4"})["reason"] == "missing_reference"
    renamed = MathReward.create(Context(options=MathConfig(answer_key="solution")))
    assert renamed("", "\\boxed{4}", {"solution": "4"})["reward"] == 1.0


def test_unparsable_answer_scores_zero_with_reason():
    result = score("\\boxed{\\frac{}{}}", "4")
    assert result["reward"] == 0.0 and result["reason"] == "unparsable_answer", result


def test_pathological_expression_times_out_and_the_pool_recovers():
    score("\\boxed{0.5}", "\\frac{1}{2}", timeout_s=1.0)  # the pool is up: its start is not timed below
    start = time.monotonic()
    result = score("\\boxed{9^{9^{9^{9}}}}", "10", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result["reward"] == 0.0 and result["reason"] == "timeout", result
    # not scaled: pebble kills the worker at the bound, well within 3 s; waiting 5 s more (the caller's backstop)
    # would mean it did not
    assert elapsed < 1.0 + 3.0, f"took {elapsed:.1f} s for a 1 s bound"
    assert score("\\boxed{0.25}", "\\frac{1}{4}", timeout_s=1.0)["reward"] == 1.0  # a fresh worker answers


def test_a_reward_worker_killed_mid_comparison_scores_that_answer_as_an_error_and_the_pool_recovers(scheduled):
    """Fault injection (issue 21): the math-verify worker process dies (SIGKILL, the OOM killer) while it
    compares: that answer scores 0 with the reason, never an exception into the rollout, and the next
    comparison gets a fresh worker."""
    import os
    import signal
    from pathlib import Path

    score("\\boxed{0.5}", "\\frac{1}{2}", timeout_s=30.0, workers=1)  # the one-worker pool is up

    def workers_of_this_process() -> list[int]:
        """The pool's worker processes: children of this one started by multiprocessing's spawn (not its
        resource tracker)."""
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit():
                    continue
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == os.getpid() and b"spawn_main" in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except (OSError, ValueError):
                continue
        return found

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(score("\\boxed{9^{9^{9^{9}}}}", "10", timeout_s=30.0,
                                                                 workers=1)))
    queued = len(scheduled)
    thread.start()
    wait_until(lambda: len(scheduled) > queued and scheduled[queued].running(), 30,
               "the comparison to run in the worker")
    victims = workers_of_this_process()
    assert victims, "no worker process found"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    thread.join(scaled(30))
    assert not thread.is_alive(), "the comparison whose worker was killed did not come back"
    assert result["reward"] == 0.0 and result["reason"] == "error", result
    assert "the worker died" in result["detail"], result
    assert score("\\boxed{0.25}", "\\frac{1}{4}", timeout_s=30.0, workers=1)["reward"] == 1.0


def test_time_queued_behind_other_comparisons_is_not_a_timeout(scheduled):
    # One worker, a 1 s bound: four pathological answers (each killed at 1 s, its worker replaced) are ahead
    # of an easy one, which waits longer than timeout_s + the grace in the queue but needs milliseconds once
    # it runs.
    slow = "\\boxed{9^{9^{9^{9}}}}"
    results: dict[str, dict] = {}

    def run(name, completion, answer):
        results[name] = score(completion, answer, timeout_s=1.0, workers=1)

    score("\\boxed{0.5}", "\\frac{1}{2}", timeout_s=1.0, workers=1)  # start the one-worker pool first
    threads = [threading.Thread(target=run, args=(f"slow{k}", slow, "10")) for k in range(4)]
    queued = len(scheduled)
    for k, t in enumerate(threads):
        t.start()
        wait_until(lambda: len(scheduled) > queued + k, 30, f"pathological answer {k} to be queued")
    easy = threading.Thread(target=run, args=("easy", "\\boxed{\\frac{3}{4}}", "0.75"))
    began = time.monotonic()
    easy.start()
    for t in [*threads, easy]:
        t.join(scaled(60))
    waited = time.monotonic() - began
    assert len(scheduled) == queued + 5  # the easy one was queued behind the four
    assert [results[f"slow{k}"]["reason"] for k in range(4)] == ["timeout"] * 4, results
    assert results["easy"]["reward"] == 1.0 and results["easy"]["reason"] == "correct", (results["easy"], waited)


def test_works_from_a_non_main_thread_and_from_the_event_loop():
    got: list[dict] = []
    thread = threading.Thread(target=lambda: got.append(score("\\boxed{\\frac{6}{8}}", "0.75")))
    thread.start()
    thread.join(scaled(60))
    assert got and got[0]["reward"] == 1.0, got
    reward = MathReward.create(Context(options=MathConfig()))
    result = asyncio.run(call_reward(reward, "", "so \\boxed{2^{10}}", {"answer": "1024"}))
    assert result.reward == 1.0 and result.info["reason"] == "correct"
