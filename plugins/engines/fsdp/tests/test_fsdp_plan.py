"""Plan rules of the fsdp backend, called directly as the hooks would be."""

from __future__ import annotations

import pytest

from areal_core.config.model_info import ModelInfo
from areal_core.testing.plans import GEN, codes, core_problems, declared, registered_hooks, validate_plan
from areal_fsdp import hooks
from areal_fsdp.hooks import areal_declare_backends, areal_validate_parallelism

# 32 query heads, 8 key-value heads (grouped-query attention).
MODEL = ModelInfo(path="m", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=24)


def validate(text: str, model: ModelInfo | None = MODEL):
    """The plan problems the fsdp hook reports."""
    return validate_plan(areal_validate_parallelism, text, model)


def test_declaration():
    assert declared(areal_declare_backends) == ("fsdp", "train", "dtc", ("gpu", "cpu"))


def test_hook_module_registers_cleanly():
    assert registered_hooks(hooks, "fsdp") == ([], ["areal_declare_backends", "areal_validate_parallelism"])


@pytest.mark.parametrize(
    "text",
    ["fsdp:d8", "fsdp:d2t4", "fsdp:t8", "fsdp:d4@cpu", "fsdp:cpu", "vllm:d2t16+fsdp:d8",
     # context parallel beside data parallel, on gpu and on cpu (gloo all-gathers keys and values too)
     "fsdp:d1c2@cpu", "fsdp:d2c2@cpu", "fsdp:c4", "fsdp:d4c2", "fsdp[actor]:d2c2@cpu+fsdp[ref]:c2@cpu"],
)
def test_valid_plans(text):
    assert validate(text) == []


def test_tensor_must_divide_heads():
    (problem,) = validate("fsdp:d2t16")
    assert problem.code == "fsdp.tensor-heads"
    assert problem.key == "allocation"
    assert "'fsdp:d2t16'" in problem.message
    assert "t16" in problem.message and "32 attention heads" in problem.message
    assert "8 key-value heads" in problem.message
    assert problem.hint == "choose t from 1, 2, 4, 8, e.g. 'fsdp:d2t8'"


def test_tensor_must_divide_odd_head_count():
    model = ModelInfo(path="m", num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)
    (problem,) = validate("fsdp:t4", model)
    assert problem.code == "fsdp.tensor-heads"
    assert "14 attention heads" in problem.message and "2 key-value heads" in problem.message
    assert "1, 2" in problem.hint


def test_unknown_model_skips_head_rules():
    assert validate("fsdp:t7", model=None) == []


@pytest.mark.parametrize("text", ["fsdp:t2@cpu", "fsdp:d2t2@cpu", "fsdp:d2t4", "fsdp:d4t8",
                                  "fsdp[actor]:d2t2+fsdp[ref]:t4"])
def test_tensor_parallel_alone_and_beside_data_parallel_is_built_on_gpu_and_cpu(text):
    assert validate(text) == []


def test_tensor_x_data_parallel_still_needs_t_to_divide_the_heads():
    (problem,) = validate("fsdp:d2t16@cpu")
    assert problem.code == "fsdp.tensor-heads"
    assert problem.hint == "choose t from 1, 2, 4, 8, e.g. 'fsdp:d2t8@cpu'"


def test_only_fsdp_components_are_judged():
    # t16 does not divide 8 kv heads, but the component is not fsdp's.
    assert validate("other:t16+fsdp:d2") == []


def test_each_component_reported():
    problems = validate("fsdp[actor]:t16+fsdp[ref]:t3")
    assert codes(problems) == ["fsdp.tensor-heads", "fsdp.tensor-heads"]
    assert "'fsdp[actor]:t16'" in problems[0].message
    assert "'fsdp[ref]:t3'" in problems[1].message


def test_core_rejects_undeclared_dimensions():
    backends = [*areal_declare_backends(), GEN]
    assert core_problems("gen:d1+fsdp:d2t2c2", *backends) == []
    problems = core_problems("gen:d1+fsdp:d2p2e4", *backends)
    assert codes(problems) == ["core.unsupported-dimension", "core.unsupported-dimension"]
    assert "p2" in problems[0].message and "e4" in problems[1].message


@pytest.mark.parametrize("text", ["fsdp:c2t2@cpu", "fsdp:d2c2t2@cpu", "fsdp:d2t2c2", "fsdp:t4c2", "fsdp:d4c4t8",
                                  "fsdp[actor]:d2c2t2+fsdp[ref]:c2t2", "vllm:t4+fsdp:c2t4@cpu"])
def test_context_x_tensor_parallel_is_built_on_gpu_and_cpu(text):
    assert validate(text) == []


def test_context_x_tensor_parallel_still_needs_t_to_divide_the_heads():
    (problem,) = validate("fsdp:t16c2")
    assert (problem.code, problem.key) == ("fsdp.tensor-heads", "allocation")
    assert "'fsdp:t16c2'" in problem.message and "32 attention heads" in problem.message
    assert problem.hint == "choose t from 1, 2, 4, 8, e.g. 'fsdp:t8c2'"


def test_a_critic_with_tensor_parallel_is_refused_as_the_engine_would():
    """FSDPEngine.initialize refuses it (NotImplementedError); the check says so before anything starts."""
    (problem,) = validate("fsdp[actor]:d2@cpu+fsdp[critic]:t2@cpu")
    assert problem.code == "fsdp.critic-tensor-parallel" and problem.key == "allocation"
    assert "'fsdp[critic]:t2@cpu': a critic with tensor parallel (t2) is not built" in problem.message
    assert problem.hint == "place the critic with data parallel only, e.g. 'fsdp[critic]:d2@cpu'"
    assert validate("fsdp[actor]:t2+fsdp[critic]:d2") == []
