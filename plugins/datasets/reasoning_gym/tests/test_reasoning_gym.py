"""The reasoning_gym dataset and reward on a few tasks, with the conformance kits."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from areal_core.api import Context, call_reward
from areal_core.config.schema import RunConfig
from areal_core.config.validate import validate_run
from areal_core.testing import DatasetConformance, RewardConformance
from areal_reasoning_gym.dataset import ReasoningGymConfig, ReasoningGymDataset
from areal_reasoning_gym.reward import ReasoningGymReward


def build(split="train", **options):
    config = RunConfig()
    config.trainer.seed = 5
    return ReasoningGymDataset.create(Context(config=config, options=ReasoningGymConfig(**options),
                                              extras={"split": split}))


def score(item, completion):
    return asyncio.run(call_reward(ReasoningGymReward(), "", completion, item))


# The generators the issue names (and chain_sum), each checked with its own verifier.
@pytest.mark.parametrize("task", ["basic_arithmetic", "gsm_symbolic", "countdown", "puzzle24", "chain_sum"])
def test_reference_answers_score_1_and_wrong_ones_0(task):
    items = list(itertools.islice(build(task=task, size=4, validation_size=4), 4))
    for item in items:
        assert item["messages"][0]["role"] == "system" and "<answer>" in item["messages"][0]["content"]
        assert item["messages"][1]["content"] == item["question"]
        assert score(item, f"Let me think.\n<answer>{item['answer']}</answer>").reward == 1.0
        assert score(item, "<answer>definitely not it</answer>").reward < 0.1  # some tasks give 0.01
        assert score(item, item["answer"]).reward == 0.0  # no tag: not an answer by default


def test_train_passes_reshuffle_reproducibly_and_len_reads_no_pass():
    a, b = build(task="chain_sum", size=30, validation_size=5), build(task="chain_sum", size=30, validation_size=5)
    assert len(a) == len(b) and len(a) > 20  # len() must not count as a pass
    first, second = [i["id"] for i in a], [i["id"] for i in a]
    assert first != second and sorted(first) == sorted(second) and len(first) == len(a)
    assert [i["id"] for i in b] == first and [i["id"] for i in b] == second
    assert first == [f"chain_sum/train/{k}" for k in range(30) if f"chain_sum/train/{k}" in set(first)]


def test_task_options_pass_through_and_bad_names_are_named():
    items = list(build(task="basic_arithmetic", size=20, validation_size=2,
                       task_options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}))
    assert all(item["metadata"]["num_terms"] == 2 for item in items)
    with pytest.raises(ValueError, match=r"'basic_arithmetc' is not a reasoning-gym task \(did you mean "
                                         r"'basic_arithmetic'\?\)"):
        build(task="basic_arithmetc")
    with pytest.raises(ValueError, match="refused dataset.task_options"):
        build(task="basic_arithmetic", task_options={"no_such_option": 1})


def test_areal_check_names_a_bad_task_bad_options_or_evaluation_without_validation():
    def problems(*overrides):
        run = validate_run(None, ["dataset.name=reasoning_gym", *overrides])
        return [(p.key, p.message) for p in run.problems if p.code.startswith("reasoning_gym.")]

    assert problems("dataset.task=gsm_symbolic") == []
    ((key, message),) = problems("dataset.task=basic_arithmetc")
    assert key == "dataset.task" and "did you mean 'basic_arithmetic'?" in message
    ((key, message),) = problems("dataset.task_options={no_such_option: 1}")
    assert key == "dataset.task_options" and "refused dataset.task_options" in message
    ((key, message),) = problems("dataset.validation_size=0")
    assert key == "dataset.validation_size" and "eval.size is 64" in message
    assert problems("dataset.validation_size=0", "eval.size=0") == []


def test_untagged_completions_scored_whole_when_asked():
    from areal_reasoning_gym.reward import ReasoningGymRewardConfig

    item = next(iter(build(task="basic_arithmetic", size=2, validation_size=2)))
    loose = ReasoningGymReward(Context(options=ReasoningGymRewardConfig(require_tag=False)))
    assert asyncio.run(call_reward(loose, "", f" {item['answer']} ", item)).reward == 1.0


def test_raw_prompt_style():
    item = next(iter(build(task="chain_sum", size=2, validation_size=2, chat=False, system_prompt="Answer briefly.")))
    assert item["prompt"] == f"Answer briefly.\n\n{item['question']}" and "messages" not in item


class TestBasicArithmetic(DatasetConformance):
    component_name = "reasoning_gym"
    options = {"task": "basic_arithmetic", "size": 60, "validation_size": 20}


class TestCountdownTask(DatasetConformance):
    component_name = "reasoning_gym"
    options = {"task": "countdown", "size": 30, "validation_size": 10}


class TestReasoningGymReward(RewardConformance):
    component_name = "reasoning_gym"
    examples = [
        ("", "<answer>-4</answer>", {"id": "x", "question": "Calculate 5 - 3 - 6.", "answer": "-4",
                                     "metadata": {"source_dataset": "basic_arithmetic", "expression": "5 - 3 - 6"}},
         1.0),
        ("", "<answer>4</answer>", {"id": "x", "question": "Calculate 5 - 3 - 6.", "answer": "-4",
                                    "metadata": {"source_dataset": "basic_arithmetic", "expression": "5 - 3 - 6"}},
         0.0),
    ]
