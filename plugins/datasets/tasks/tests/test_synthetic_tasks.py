"""The arithmetic and countdown datasets: the issue-8 prompt, graded difficulty, the split."""

from __future__ import annotations

import itertools

import pytest

from areal_core import ProblemsError
from areal_core.api import Context
from areal_core.config.validate import validate_run
from areal_core.testing import DatasetConformance
from areal_tasks.arithmetic import ArithmeticConfig, ArithmeticDataset
from areal_tasks.countdown import CountdownConfig, CountdownDataset, check
from areal_tasks.expression import evaluate


def take(dataset, n):
    return list(itertools.islice(iter(dataset), n))


def test_default_arithmetic_is_the_issue_8_few_shot_prompt():
    items = take(ArithmeticDataset(Context(options=ArithmeticConfig())), 300)
    for item in items:
        a, b = map(int, item["expression"].split("+"))
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert item["prompt"] == f"3+4=7\n10+5=15\n8+9=17\n{a}+{b}="
        # As TRL's GRPOTrainer: no stop string, the completion runs on to max_new_tokens (the reward reads its start)
        assert item["answer"] == str(a + b) and "stop" not in item and "messages" not in item
    assert len({i["expression"] for i in items}) > 150  # spread over the 441 problems
    stopped = take(ArithmeticDataset(Context(options=ArithmeticConfig(stop_at_newline=True))), 5)
    assert [i["prompt"] for i in stopped] == [i["prompt"] for i in items[:5]]
    assert all(i["stop"] == ["\n"] for i in stopped)


def test_chat_style_grades_difficulty_by_digits_and_computes_answers():
    options = ArithmeticConfig(style="chat", digits=3, operands=3, operators=["+", "-", "*"])
    items = take(ArithmeticDataset(Context(options=options)), 200)
    assert {i["level"] for i in items} == {1, 2, 3}
    for item in items:
        assert item["messages"][0]["content"].startswith(f"Compute {item['expression']}.")
        assert item["answer"] == str(int(evaluate(item["expression"]).value)) and "stop" not in item
    assert any("*" in i["expression"] for i in items) and any("-" in i["expression"] for i in items)


def test_bad_options_are_reported_with_their_keys():
    with pytest.raises(ProblemsError) as err:
        ArithmeticDataset(Context(options=ArithmeticConfig(operators=["^"], min_value=9, max_value=3)))
    assert [p.key for p in err.value.problems] == ["dataset.operators", "dataset.min_value"]
    run = validate_run(None, ["dataset.name=countdown", "dataset.min_target=50", "dataset.max_target=20"])
    assert [p.key for p in run.problems if p.code.startswith("tasks.")] == ["dataset.min_target"]
    run = validate_run(None, ["dataset.name=files"])
    assert [(p.code, p.key) for p in run.problems if p.code.startswith("tasks.")] == [("tasks.no-path", "dataset.path")]
    run = validate_run(None, ["dataset.name=files", "dataset.path=/no/such.jsonl"])
    assert [p.message for p in run.problems if p.code.startswith("tasks.")] == ["/no/such.jsonl does not exist"]


def test_validation_set_larger_than_the_problem_space_is_refused():
    with pytest.raises(ValueError, match="dataset.validation_size is 20"):
        ArithmeticDataset(Context(options=ArithmeticConfig(min_value=0, max_value=2, validation_size=20)))


def test_a_spent_problem_space_is_refused_at_once_and_the_validation_size_is_bounded():
    """441 problems asked for 10,000 held-out ones: refused after ~50 fruitless draws per problem found, not
    after 50 per problem wanted (areal check took minutes on 10**8); above 10,000 is a range problem."""
    import re

    with pytest.raises(ValueError, match="only 441 distinct problems") as err:
        ArithmeticDataset(Context(options=ArithmeticConfig(validation_size=10_000)))
    assert int(re.search(r"found in (\d+) draws", str(err.value)).group(1)) <= 441 * 60
    run = validate_run(None, ["dataset.name=countdown", "dataset.validation_size=100000000"])
    assert [p.message for p in run.problems if p.key == "dataset.validation_size"] == [
        "100000000 is out of range; it must be <= 10000"]


def test_areal_check_refuses_evaluation_without_validation_problems():
    def problems(*overrides):
        run = validate_run(None, ["dataset.name=arithmetic", *overrides])
        return [(p.key, p.message) for p in run.problems if p.code.startswith("tasks.")]

    assert problems() == []
    ((key, message),) = problems("dataset.validation_size=0")
    assert key == "dataset.validation_size" and "eval.size is 64" in message
    assert problems("dataset.validation_size=0", "eval.size=0") == []
    # operands 0..1 make four problems (0+0, 0+1, 1+0, 1+1): not enough for a validation set of 20
    ((key, message),) = problems("dataset.max_value=1", "dataset.validation_size=20")
    assert key == "dataset.validation_size" and "only 4 distinct problems" in message


def test_countdown_problems_are_solvable_by_their_reference_answer():
    for options in (CountdownConfig(), CountdownConfig(use_all=True, count=3)):
        items = take(CountdownDataset(Context(options=options)), 100)
        for item in items:
            valid, hit, reason = check(item["answer"], item)
            assert valid and hit, f"{item}: {reason}"
            assert options.min_target <= item["target"] <= options.max_target


def test_finite_train_split_has_its_size_and_reshuffles_per_pass():
    dataset = ArithmeticDataset(Context(options=ArithmeticConfig(size=50)))
    first, second = [i["id"] for i in dataset], [i["id"] for i in dataset]
    assert len(dataset) == 50 and len(first) == 50
    assert sorted(first) == sorted(second) and first != second
    with pytest.raises(TypeError, match="endless"):
        len(ArithmeticDataset(Context(options=ArithmeticConfig())))


class TestArithmeticConformance(DatasetConformance):
    component_name = "arithmetic"
    take = 500  # far past the 441 problems' worth of draws: a leak would show
    options = {"validation_size": 100}


class TestArithmeticChatConformance(DatasetConformance):
    component_name = "arithmetic"
    options = {"style": "chat", "digits": 2, "operands": 3, "size": 30}


class TestCountdownConformance(DatasetConformance):
    component_name = "countdown"
    options = {"count": 3, "max_number": 10, "max_target": 40, "validation_size": 30}
    take = 200


def test_a_files_path_the_file_system_cannot_resolve_is_a_missing_file_not_a_crash():
    for path in ("~no-such-user-here/train.jsonl", "x" * 300 + ".jsonl"):
        run = validate_run(None, ["dataset.name=files", f"dataset.path={path}"])
        assert [p.code for p in run.problems if p.key == "dataset.path"] == ["tasks.missing-file"], run.problems
