"""The conformance kit, run as a plugin author runs it, against test doubles.

Each test writes a test module subclassing the kit's suites (as a third
party would), runs it in-process with pytester and checks, test by test,
that good doubles pass and that each broken double fails the test of the
rule it breaks, with a message saying what is wrong. The doubles are found
through entry points of fake installed distributions, like real plugins.
"""

from __future__ import annotations

# pytester's in-process runs unload every module first imported during them, and
# torch's operator libraries cannot be registered twice in one process: import
# torch and the model code other test files use before any pytester run.
try:
    import torch  # noqa: F401
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401
except ImportError:  # a core-only environment: nothing to protect
    pass

import asyncio
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from areal_core.api import GenerationRequest, SamplingParams
from areal_core.registry import resolve
from areal_core.testing import (
    AlgorithmConformance, ComponentConformance, InferenceEngineConformance, RewardConformance,
    ScriptedInferenceEngine, TrainEngineConformance, WorkflowConformance, engine_spans,
    install_fake_distribution,
)
from areal_core.testing.base import public_tests

pytest_plugins = ["pytester"]

DOUBLES = Path(__file__).parent / "doubles"
KIT_MODULES = ["echo_engine_double.py", "reward_doubles.py", "workflow_doubles.py",
               "algorithm_doubles.py", "train_engine_doubles.py"]

KIT_ENTRY_POINTS = {
    "areal.engines.inference": {
        "echo_engine_double": "echo_engine_double:EchoInferenceEngineDouble",
        "short_logprobs_engine_double": "echo_engine_double:ShortLogprobsEngineDouble",
        "positive_logprobs_engine_double": "echo_engine_double:PositiveLogprobsEngineDouble",
        "ignores_pause_engine_double": "echo_engine_double:IgnoresPauseEngineDouble",
        "stale_version_engine_double": "echo_engine_double:StaleVersionEngineDouble",
        "waiting_pause_engine_double": "echo_engine_double:WaitingPauseEngineDouble",
        "misspelt_capability_engine_double": "echo_engine_double:MisspeltCapabilityEngineDouble",
        "permuting_loader_engine_double": "echo_engine_double:PermutingLoaderEngineDouble",
        "pausing_digest_engine_double": "echo_engine_double:PausingDigestEngineDouble",
    },
    "areal.rewards": {
        "toy_reward_double": "reward_doubles:ToyRewardDouble",
        "async_dict_reward_double": "reward_doubles:async_dict_reward_double",
        "string_reward_double": "reward_doubles:StringRewardDouble",
        "empty_crash_reward_double": "reward_doubles:EmptyCrashRewardDouble",
        "random_reward_double": "reward_doubles:RandomRewardDouble",
        "off_by_one_reward_double": "reward_doubles:OffByOneRewardDouble",
        "no_default_config_reward_double": "reward_doubles:NoDefaultConfigRewardDouble",
    },
    "areal.workflows": {
        "toy_workflow_double": "workflow_doubles:ToyWorkflowDouble",
        "multi_turn_workflow_double": "workflow_doubles:ToyMultiTurnWorkflowDouble",
        "retokenizing_workflow_double": "workflow_doubles:RetokenizingWorkflowDouble",
        "mask_everything_workflow_double": "workflow_doubles:MaskEverythingWorkflowDouble",
        "zero_version_workflow_double": "workflow_doubles:ZeroVersionWorkflowDouble",
        "nan_reward_workflow_double": "workflow_doubles:NanRewardWorkflowDouble",
        "incomplete_workflow_double": "workflow_doubles:IncompleteWorkflowDouble",
    },
    "areal.algorithms": {
        "toy_algorithm_double": "algorithm_doubles:ToyAlgorithmDouble",
        "per_sequence_algorithm_double": "algorithm_doubles:PerSequenceAdvantageAlgorithmDouble",
        "no_stats_algorithm_double": "algorithm_doubles:LossWithoutStatsAlgorithmDouble",
        "dict_needs_algorithm_double": "algorithm_doubles:DictNeedsAlgorithmDouble",
    },
    "areal.engines.train": {
        "bigram_train_engine_double": "train_engine_doubles:BigramTrainEngineDouble",
        "no_step_train_engine_double": "train_engine_doubles:NoStepTrainEngineDouble",
        "forgetful_load_train_engine_double": "train_engine_doubles:ForgetfulLoadTrainEngineDouble",
        "view_export_train_engine_double": "train_engine_doubles:ViewExportTrainEngineDouble",
        "racy_export_train_engine_double": "train_engine_doubles:RacyExportTrainEngineDouble",
        "into_ignored_train_engine_double": "train_engine_doubles:IntoIgnoredTrainEngineDouble",
        "one_step_minibatch_train_engine_double": "train_engine_doubles:OneStepMinibatchTrainEngineDouble",
    },
}

HEADER = """
from areal_core.api import Context
from areal_core.testing import (
    AlgorithmConformance, InferenceEngineConformance, RewardConformance, TrainEngineConformance,
    WorkflowConformance,
)
"""


@pytest.fixture
def kit_doubles(tmp_path):
    """The doubles, installed as distribution ``areal-kit-doubles``."""
    files = {name: (DOUBLES / name).read_text() for name in KIT_MODULES}
    with install_fake_distribution(tmp_path / "site", "areal-kit-doubles", "0.0.1", KIT_ENTRY_POINTS, files) as site:
        yield site


def run_kit(pytester: pytest.Pytester, *sources: str) -> dict[str, tuple[str, str]]:
    """Run ``sources`` (test classes) in-process; ``"Class::test" -> (outcome, message)``."""
    pytester.makepyfile(test_plugin_conformance=HEADER + "\n".join(textwrap.dedent(s) for s in sources))
    recorder = pytester.inline_run("-p", "no:cacheprovider", "--disable-plugin-autoload")
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    results: dict[str, tuple[str, str]] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        key = report.nodeid.split("::", 1)[1]
        if report.skipped:
            message = report.longrepr[2]
        else:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr or "")
        if key not in results or rank[report.outcome] > rank[results[key][0]]:
            results[key] = (report.outcome, message)
    return results


def outcomes(results: dict[str, tuple[str, str]], cls: str) -> dict[str, set[str]]:
    by_outcome: dict[str, set[str]] = {"passed": set(), "skipped": set(), "failed": set()}
    for key, (outcome, _) in results.items():
        owner, test = key.split("::")
        if owner == cls:
            by_outcome[outcome].add(test)
    return by_outcome


def failed(results: dict[str, tuple[str, str]], cls: str) -> set[str]:
    return outcomes(results, cls)["failed"]


def message(results: dict[str, tuple[str, str]], key: str) -> str:
    return " ".join(results[key][1].split())


# --------------------------------------------------------------------- rewards
def test_reward_suite_passes_good_rewards_and_fails_each_broken_one(pytester, kit_doubles):
    results = run_kit(pytester, """
        EXAMPLES = [("2+2=", "it is 4", {"answer": 4}, 1.0), ("2+2=", "it is 5", {"answer": 4}, 0.0)]

        class TestToyReward(RewardConformance):
            component_name = "toy_reward_double"
            examples = EXAMPLES

        class TestAsyncDictReward(RewardConformance):
            component_name = "async_dict_reward_double"

        class TestStringReward(RewardConformance):
            component_name = "string_reward_double"

        class TestEmptyCrashReward(RewardConformance):
            component_name = "empty_crash_reward_double"
            examples = EXAMPLES

        class TestRandomReward(RewardConformance):
            component_name = "random_reward_double"

        class TestOffByOneReward(RewardConformance):
            component_name = "off_by_one_reward_double"
            examples = EXAMPLES

        class TestNoDefaultConfigReward(RewardConformance):
            component_name = "no_default_config_reward_double"

            def make(self, cls):
                return cls.create(Context(options=cls.config_class(threshold=0.5)))
    """)
    every = set(public_tests(RewardConformance))
    assert outcomes(results, "TestToyReward") == {"passed": every, "skipped": set(), "failed": set()}
    # No config_class (no keys of its own) and no examples: those two checks skip, naming why.
    not_applicable = {"test_examples_score_as_expected", "test_config_class_is_a_dataclass_with_defaults"}
    assert outcomes(results, "TestAsyncDictReward") == {
        "passed": every - not_applicable, "skipped": not_applicable, "failed": set()}
    assert "has no config_class" in message(
        results, "TestAsyncDictReward::test_config_class_is_a_dataclass_with_defaults")
    assert "TestAsyncDictReward.examples is empty" in message(
        results, "TestAsyncDictReward::test_examples_score_as_expected")

    value_tests = {"test_returns_a_finite_float_or_a_dict_with_reward", "test_empty_completion_does_not_raise",
                   "test_long_garbage_completion_does_not_raise", "test_is_deterministic"}
    assert failed(results, "TestStringReward") == value_tests
    assert ("string_reward_double on an empty completion: reward StringRewardDouble returned '1.0'; a reward "
            "returns a float or a dict with 'reward'") in message(
        results, "TestStringReward::test_empty_completion_does_not_raise")

    assert failed(results, "TestEmptyCrashReward") == {"test_empty_completion_does_not_raise"}
    assert ("empty_crash_reward_double raised IndexError: list index out of range on an empty completion"
            in message(results, "TestEmptyCrashReward::test_empty_completion_does_not_raise"))

    assert failed(results, "TestRandomReward") == {"test_is_deterministic"}
    assert "a reward must be deterministic" in message(results, "TestRandomReward::test_is_deterministic")

    assert failed(results, "TestOffByOneReward") == {"test_examples_score_as_expected"}
    assert "completion 'it is 4', item {'answer': 4}: expected 1.0, got 0.0" in message(
        results, "TestOffByOneReward::test_examples_score_as_expected")

    assert failed(results, "TestNoDefaultConfigReward") == {"test_config_class_is_a_dataclass_with_defaults"}
    assert "NoDefaultConfigDouble fields threshold have no default" in message(
        results, "TestNoDefaultConfigReward::test_config_class_is_a_dataclass_with_defaults")


# ------------------------------------------------------------------- workflows
def test_workflow_suite_checks_token_in_token_out(pytester, kit_doubles):
    results = run_kit(pytester, """
        ITEMS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "skip me", "skip": True}]

        class TestToyWorkflow(WorkflowConformance):
            component_name = "toy_workflow_double"
            items = ITEMS

        class TestMultiTurnWorkflow(WorkflowConformance):
            component_name = "multi_turn_workflow_double"
            items = ITEMS[:1]

        class TestRetokenizingWorkflow(WorkflowConformance):
            component_name = "retokenizing_workflow_double"
            items = ITEMS

        class TestMaskEverythingWorkflow(WorkflowConformance):
            component_name = "mask_everything_workflow_double"
            items = ITEMS

        class TestZeroVersionWorkflow(WorkflowConformance):
            component_name = "zero_version_workflow_double"
            items = ITEMS

        class TestNanRewardWorkflow(WorkflowConformance):
            component_name = "nan_reward_workflow_double"
            items = ITEMS

        class TestAllRejected(WorkflowConformance):
            component_name = "toy_workflow_double"
            items = ITEMS[1:]
    """)
    every = set(public_tests(WorkflowConformance))
    no_keys = {"test_config_class_is_a_dataclass_with_defaults"}  # workflow doubles without keys of their own
    for double in ("TestToyWorkflow", "TestMultiTurnWorkflow"):
        assert outcomes(results, double) == {"passed": every - no_keys, "skipped": no_keys, "failed": set()}

    # Its re-made ids are not the engine's, yet it trains on them and tags them with a version.
    assert failed(results, "TestRetokenizingWorkflow") == {"test_loss_mask_is_one_exactly_on_engine_tokens",
                                                           "test_engine_tokens_keep_their_logprobs_and_versions"}
    assert ("contains none of the token ids the engine returned ([[5101, 5102, 5103, 5104, 5105], "
            "[5201, 5202, 5203]]). Token-in / token-out: keep the ids the engine returns; never decode and "
            "re-encode a model's output") in message(
        results, "TestRetokenizingWorkflow::test_loss_mask_is_one_exactly_on_engine_tokens")

    assert failed(results, "TestMaskEverythingWorkflow") == {"test_loss_mask_is_one_exactly_on_engine_tokens"}
    assert ("trajectory 0 of item {'prompt': '1+1=', 'answer': '2'}: positions 0..3 (ids [49, 43, 49, 61]) "
            "have loss_mask 1, but the engine never produced them") in message(
        results, "TestMaskEverythingWorkflow::test_loss_mask_is_one_exactly_on_engine_tokens")

    assert failed(results, "TestZeroVersionWorkflow") == {"test_engine_tokens_keep_their_logprobs_and_versions"}
    assert "versions at positions 4..8 are [0, 0, 0, 0, 0]; the engine (at version 3) tagged them [3, 3, 3, 3, 3]" \
        in message(results, "TestZeroVersionWorkflow::test_engine_tokens_keep_their_logprobs_and_versions")

    assert failed(results, "TestNanRewardWorkflow") == {"test_rewards_are_finite"}
    assert "reward is nan; it must be a finite number" in message(
        results, "TestNanRewardWorkflow::test_rewards_are_finite")

    assert failed(results, "TestAllRejected") == every - set(public_tests(ComponentConformance))
    assert "rejected every item" in message(results, "TestAllRejected::test_returns_none_or_a_list_of_trajectories")


def test_every_kind_fails_a_component_that_does_not_implement_its_contract(pytester, kit_doubles, tmp_path):
    # A distribution of its own: `areal plugins` reports it, so it would mark the good doubles' distribution too.
    broken = install_fake_distribution(tmp_path / "broken", "areal-kit-broken", "0.0.1", {"areal.workflows": {
        "missing_module_workflow_double": "no_such_module_double:WorkflowDouble"}}, {})
    with broken:
        results = run_kit(pytester, """
            class TestIncompleteWorkflow(WorkflowConformance):
                component_name = "incomplete_workflow_double"
                items = [{"prompt": "x"}]

            class TestMissingModuleWorkflow(WorkflowConformance):
                component_name = "missing_module_workflow_double"

            class TestMisspeltName(WorkflowConformance):
                component_name = "toy_workflow_dubble"
        """)
    assert "test_entry_point_resolves_to_the_contract" in failed(results, "TestIncompleteWorkflow")
    assert "leaves arun_episode of Workflow unimplemented, so it cannot be built" in message(
        results, "TestIncompleteWorkflow::test_entry_point_resolves_to_the_contract")
    assert ("workflow 'missing_module_workflow_double' from areal-kit-broken 0.0.1 failed to import "
            "(no_such_module_double:WorkflowDouble): areal-kit-broken 0.0.1 does not ship module "
            "no_such_module_double") in message(
        results, "TestMissingModuleWorkflow::test_entry_point_resolves_to_the_contract")
    assert "Did you mean 'toy_workflow_double'?" in message(
        results, "TestMisspeltName::test_entry_point_resolves_to_the_contract")


# ----------------------------------------------------------- inference engines
ENGINE_SUITE = """
    import os

    class EngineSuite(InferenceEngineConformance):
        prompt_ids = [11, 12, 13]
        long_max_new_tokens = 400

        def weights_path_for_update(self):  # one small safetensors file
            import torch
            from safetensors.torch import save_file

            folder = os.path.join(os.path.dirname(__file__), "weights")
            os.makedirs(folder, exist_ok=True)
            save_file({"layer.weight": torch.arange(12.0).reshape(3, 4), "layer.bias": torch.ones(3)},
                      os.path.join(folder, "model.safetensors"))
            return folder
"""


def test_inference_engine_suite_passes_the_echo_double_and_fails_broken_engines(pytester, kit_doubles):
    results = run_kit(pytester, ENGINE_SUITE, """
        class TestEchoEngine(EngineSuite):
            component_name = "echo_engine_double"

        class TestShortLogprobsEngine(EngineSuite):
            component_name = "short_logprobs_engine_double"

        class TestPositiveLogprobsEngine(EngineSuite):
            component_name = "positive_logprobs_engine_double"

        class TestIgnoresPauseEngine(EngineSuite):
            component_name = "ignores_pause_engine_double"

        class TestStaleVersionEngine(EngineSuite):
            component_name = "stale_version_engine_double"

        class TestWaitingPauseEngine(EngineSuite):
            component_name = "waiting_pause_engine_double"

            def diagnostics(self, engine):
                return "server log tail of the waiting double"

        class TestPermutingLoaderEngine(EngineSuite):
            component_name = "permuting_loader_engine_double"

        class TestPausingDigestEngine(EngineSuite):
            component_name = "pausing_digest_engine_double"
    """)
    every = set(public_tests(InferenceEngineConformance))
    assert outcomes(results, "TestEchoEngine") == {"passed": every, "skipped": set(), "failed": set()}

    generating = {t for t in every if "generat" in t or "logprobs" in t or "versions" in t or "seed" in t
                  or "concurrent" in t or "pause" in t or "update" in t or "request_runs" in t}
    assert failed(results, "TestShortLogprobsEngine") == generating
    assert "8 output tokens but 7 logprobs" in message(
        results, "TestShortLogprobsEngine::test_generate_stays_within_max_new_tokens")

    assert failed(results, "TestPositiveLogprobsEngine") == {"test_logprobs_are_finite_and_not_positive"}
    assert "logprobs must be finite log-probabilities <= 0 (not logits or probabilities)" in message(
        results, "TestPositiveLogprobsEngine::test_logprobs_are_finite_and_not_positive")

    assert failed(results, "TestIgnoresPauseEngine") == {"test_pause_returns_partial_output_and_resume_continues"}
    assert "ended with stop_reason 'length' after 400 tokens; pause() must return it with 'abort'" in message(
        results, "TestIgnoresPauseEngine::test_pause_returns_partial_output_and_resume_continues")

    assert failed(results, "TestWaitingPauseEngine") == {"test_pause_returns_partial_output_and_resume_continues"}
    waiting = message(results, "TestWaitingPauseEngine::test_pause_returns_partial_output_and_resume_continues")
    assert "pause() must abort in-flight requests, not wait for them to finish" in waiting
    assert "server log tail of the waiting double" in waiting  # what the suite's diagnostics() adds
    assert waiting.count("came back complete (400 tokens, stop_reason 'length')") == 5  # every attempt, each seed

    assert failed(results, "TestPermutingLoaderEngine") == {"test_weight_digest_matches_the_weights_loaded",
                                                            "test_weight_digest_answers_while_a_request_runs"}
    digest_failure = message(results, "TestPermutingLoaderEngine::test_weight_digest_matches_the_weights_loaded")
    assert "differs from the digests the trainer computes (PermutingLoaderEngineDouble.sent_digests, by default " \
           "areal_core.weight_check.digest_folder) for 1 of 2 tensors, e.g. ['layer.weight: sent float32[3,4]:" \
           in digest_failure

    assert failed(results, "TestPausingDigestEngine") == {"test_weight_digest_answers_while_a_request_runs"}
    assert "asking for the digests must not interrupt generation" in message(
        results, "TestPausingDigestEngine::test_weight_digest_answers_while_a_request_runs")

    assert failed(results, "TestStaleVersionEngine") == {"test_update_weights_from_disk_sets_the_version",
                                                         "test_weight_digest_answers_while_a_request_runs"}
    assert "tokens generated after the update to version 1 carry [0, 0" in message(
        results, "TestStaleVersionEngine::test_update_weights_from_disk_sets_the_version")


def test_undeclared_capabilities_are_skipped_with_their_name(pytester, kit_doubles):
    results = run_kit(pytester, ENGINE_SUITE, """
        class TestEchoSeedOnly(EngineSuite):
            component_name = "echo_engine_double"
            capabilities = frozenset({"seed"})

        class TestEchoOverclaimed(EngineSuite):
            component_name = "echo_engine_double"
            capabilities = frozenset({"seed", "update_weights_from_tensors"})

        class TestMisspeltCapability(EngineSuite):
            component_name = "misspelt_capability_engine_double"
    """)
    assert outcomes(results, "TestEchoSeedOnly")["skipped"] == {
        "test_pause_returns_partial_output_and_resume_continues", "test_update_weights_from_disk_sets_the_version",
        "test_weight_digest_matches_the_weights_loaded", "test_weight_digest_answers_while_a_request_runs"}
    assert message(results, "TestEchoSeedOnly::test_pause_returns_partial_output_and_resume_continues") == (
        "Skipped: echo_engine_double does not declare capability 'pause'")
    assert message(results, "TestEchoSeedOnly::test_update_weights_from_disk_sets_the_version") == (
        "Skipped: echo_engine_double does not declare capability 'update_weights_from_disk'")
    assert failed(results, "TestEchoSeedOnly") == set()

    assert failed(results, "TestEchoOverclaimed") == {"test_declared_capabilities_are_implemented"}
    assert ("TestEchoOverclaimed tests capabilities ['update_weights_from_tensors'] that echo_engine_double "
            "does not declare") in message(results, "TestEchoOverclaimed::test_declared_capabilities_are_implemented")

    assert failed(results, "TestMisspeltCapability") == {"test_declared_capabilities_are_implemented"}
    assert ("misspelt_capability_engine_double declares capabilities ['puase'], which are not inference engine "
            "capabilities (misspelt?)") in message(
        results, "TestMisspeltCapability::test_declared_capabilities_are_implemented")
    assert message(results, "TestMisspeltCapability::test_pause_returns_partial_output_and_resume_continues") == (
        "Skipped: misspelt_capability_engine_double does not declare capability 'pause'")


# --------------------------------------------------------------- train engines
def test_train_engine_suite_checks_steps_and_checkpoints(pytester, kit_doubles):
    pytest.importorskip("torch")  # imported here, so the in-process run below keeps it loaded
    results = run_kit(pytester, """
        class TrainSuite(TrainEngineConformance):
            def make_batch(self):
                import torch

                ids = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9]
                return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]),
                        "cu_seqlens": torch.tensor([0, 5, 11]), "loss_mask": torch.ones(11)}

        class TestBigramEngine(TrainSuite):
            component_name = "bigram_train_engine_double"

        class TestNoStepEngine(TrainSuite):
            component_name = "no_step_train_engine_double"

        class TestForgetfulLoadEngine(TrainSuite):
            component_name = "forgetful_load_train_engine_double"

        class TestViewExportEngine(TrainSuite):
            component_name = "view_export_train_engine_double"

        class TestRacyExportEngine(TrainSuite):
            component_name = "racy_export_train_engine_double"

        class TestIntoIgnoredEngine(TrainSuite):
            component_name = "into_ignored_train_engine_double"

        class TestOneStepMinibatchEngine(TrainSuite):
            component_name = "one_step_minibatch_train_engine_double"
    """)
    every = set(public_tests(TrainEngineConformance))
    assert outcomes(results, "TestBigramEngine") == {"passed": every, "skipped": set(), "failed": set()}
    # Without steps the weights never move, so a load has nothing to restore: the loss test fails, and the
    # export test, which then sees no update to guard against, says so.
    assert failed(results, "TestNoStepEngine") == {"test_training_lowers_the_loss",
                                                  "test_exported_tensors_are_copies_that_a_later_step_leaves_alone"}
    assert "saw no update to guard against" in message(
        results, "TestNoStepEngine::test_exported_tensors_are_copies_that_a_later_step_leaves_alone")
    assert "train_batch must step the optimizer on the loss_fn it is given" in message(
        results, "TestNoStepEngine::test_training_lowers_the_loss")
    assert failed(results, "TestForgetfulLoadEngine") == {"test_load_restores_the_saved_weights"}
    assert "load must restore the weights saved" in message(
        results, "TestForgetfulLoadEngine::test_load_restores_the_saved_weights")
    assert failed(results, "TestViewExportEngine") == {
        "test_exported_tensors_are_copies_that_a_later_step_leaves_alone"}
    assert "export_tensors must hand out copies" in message(
        results, "TestViewExportEngine::test_exported_tensors_are_copies_that_a_later_step_leaves_alone")
    assert failed(results, "TestRacyExportEngine") == {
        "test_an_export_read_on_another_thread_holds_the_next_optimizer_step"}
    assert "the optimizer step must wait until its last bucket is read" in message(
        results, "TestRacyExportEngine::test_an_export_read_on_another_thread_holds_the_next_optimizer_step")
    assert failed(results, "TestIntoIgnoredEngine") == {
        "test_an_export_into_given_memory_writes_there_and_equals_an_ordinary_export"}
    assert "never asked `into` for memory" in message(
        results, "TestIntoIgnoredEngine::test_an_export_into_given_memory_writes_there_and_equals_an_ordinary_export")
    assert failed(results, "TestOneStepMinibatchEngine") == {
        "test_minibatches_and_epochs_are_optimizer_steps_of_one_update"}
    assert "it must take 4" in message(
        results, "TestOneStepMinibatchEngine::test_minibatches_and_epochs_are_optimizer_steps_of_one_update")


# ------------------------------------------------------------------ algorithms
def test_algorithm_suite_checks_advantages_and_loss(pytester, kit_doubles):
    results = run_kit(pytester, """
        class AlgorithmSuite(AlgorithmConformance):
            def make_batch(self):
                return {"input_ids": [1, 2, 3, 4, 5, 6, 7], "cu_seqlens": [0, 3, 7],
                        "loss_mask": [0, 1, 1, 0, 1, 1, 1], "logprobs": [-0.5] * 7, "rewards": [1.0, 0.0]}

        class TestToyAlgorithm(AlgorithmSuite):
            component_name = "toy_algorithm_double"

        class TestPerSequenceAlgorithm(AlgorithmSuite):
            component_name = "per_sequence_algorithm_double"

        class TestNoStatsAlgorithm(AlgorithmSuite):
            component_name = "no_stats_algorithm_double"

        class TestDictNeedsAlgorithm(AlgorithmSuite):
            component_name = "dict_needs_algorithm_double"
    """)
    every = set(public_tests(AlgorithmConformance))
    assert outcomes(results, "TestToyAlgorithm") == {"passed": every, "skipped": set(), "failed": set()}
    assert failed(results, "TestPerSequenceAlgorithm") == {"test_compute_advantages_adds_one_advantage_per_token"}
    assert "2 advantages for 7 tokens" in message(
        results, "TestPerSequenceAlgorithm::test_compute_advantages_adds_one_advantage_per_token")
    assert failed(results, "TestNoStatsAlgorithm") == {"test_loss_returns_a_finite_scalar_and_stats"}
    assert "it must return (scalar loss, stats dict)" in message(
        results, "TestNoStatsAlgorithm::test_loss_returns_a_finite_scalar_and_stats")
    assert failed(results, "TestDictNeedsAlgorithm") == {"test_needs_is_a_needs"}


# --------------------------------------------------------- packaging and hooks
def test_a_broken_hook_in_the_same_distribution_fails_the_listing_test(pytester, tmp_path):
    files = {"misspelt_hook_double.py": (DOUBLES / "misspelt_hook_double.py").read_text()}
    entry_points = {"areal.rewards": {"constant_reward_double": "misspelt_hook_double:ConstantRewardDouble"},
                    "areal": {"misspelt-double": "misspelt_hook_double"}}
    with install_fake_distribution(tmp_path / "site", "areal-misspelt-double", "2.0.0", entry_points, files):
        results = run_kit(pytester, """
            class TestConstantReward(RewardConformance):
                component_name = "constant_reward_double"
        """)
    assert failed(results, "TestConstantReward") == {"test_distribution_loads_cleanly_in_areal_plugins"}
    assert ('`areal plugins` reports for areal-misspelt-double 2.0.0: plugin "misspelt-double" '
            "(areal-misspelt-double 2.0.0): areal_register_command is not an areal hook. Fix: rename it "
            "to areal_register_commands.") in message(
        results, "TestConstantReward::test_distribution_loads_cleanly_in_areal_plugins")


def test_fake_distribution_is_visible_inside_and_gone_after(tmp_path):
    eps = {"areal.rewards": {"fake_reward_double": "fake_reward_double:reward"}}
    files = {"fake_reward_double.py": "def reward(prompt, completion, item):\n    return 1.0\n"}
    with install_fake_distribution(tmp_path, "areal-fake-double", "1.2.3", eps, files) as site:
        assert site == tmp_path.resolve()
        assert metadata.version("areal-fake-double") == "1.2.3"
        assert resolve("reward", "fake_reward_double")("", "", None) == 1.0
        assert "fake_reward_double" in sys.modules
    assert "fake_reward_double" not in sys.modules
    assert str(tmp_path.resolve()) not in sys.path
    assert not list(tmp_path.glob("*.dist-info")) and (tmp_path / "fake_reward_double.py").exists()
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("areal-fake-double")


# ---------------------------------------------------------- the kit's helpers
def test_scripted_engine_replays_its_script_with_distinct_logprobs():
    engine = ScriptedInferenceEngine([[7, 8, 9], [5, 6]], version=4)

    async def main():
        return [await engine.agenerate(GenerationRequest([1, 2], SamplingParams(max_new_tokens=m, stop_token_ids=s)))
                for m, s in [(2, ()), (8, ()), (8, (8,))]]

    cut, whole, stopped = asyncio.run(main())
    assert (cut.output_ids, cut.stop_reason) == ([7, 8], "length")
    assert (whole.output_ids, whole.stop_reason, whole.output_versions) == ([5, 6], "stop", [4, 4])
    assert (stopped.output_ids, stopped.stop_reason) == ([7, 8], "stop")
    logprobs = cut.output_logprobs + whole.output_logprobs + stopped.output_logprobs
    assert all(lp < 0 for lp in logprobs) and len(set(logprobs)) == len(logprobs)
    assert engine.responses == [cut, whole, stopped]


def test_engine_spans_find_outputs_and_their_leading_parts():
    engine = ScriptedInferenceEngine([[50, 51, 52], [60, 61]])

    async def main():
        return [await engine.agenerate(GenerationRequest([1])) for _ in range(2)]

    responses = asyncio.run(main())
    spans = engine_spans([1, 2, 50, 51, 52, 3, 60, 9, 51], responses)
    assert [(s.start, s.end) for s in spans] == [(2, 5), (6, 7)]


def test_importing_the_core_imports_neither_the_kit_nor_torch():
    code = ("import sys, areal_core, areal_core.api, areal_core.registry, areal_core.plugins\n"
            "assert 'areal_core.testing' not in sys.modules, 'core imported the kit'\n"
            "import areal_core.testing\n"
            "assert 'torch' not in sys.modules, 'the kit imported torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("suite", [RewardConformance, WorkflowConformance, InferenceEngineConformance,
                                   TrainEngineConformance, AlgorithmConformance])
def test_suites_are_not_collected_until_subclassed(suite):
    assert not suite.__name__.startswith("Test") and "__init__" not in vars(suite)


def test_no_kit_check_passes_by_returning_early():
    """A kit check that does not apply to a component skips with the reason; one that returned early would be
    reported as passed while it checked nothing (issue 22)."""
    import ast
    from pathlib import Path

    import areal_core.testing

    early = []
    for path in Path(areal_core.testing.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                early += [f"{path.name}:{sub.lineno} {node.name}" for sub in ast.walk(node)
                          if isinstance(sub, ast.Return) and sub.value is None]
    assert not early, "kit checks that return without asserting (skip instead): " + ", ".join(early)
