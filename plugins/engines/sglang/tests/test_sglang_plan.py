"""Plan rules of the sglang backend, called directly as the hooks would be."""

from __future__ import annotations

import pytest

from areal_core.config.model_info import ModelInfo
from areal_core.config.schema import RunConfig
from areal_core.testing.plans import TRAINER, codes, core_problems, declared, registered_hooks, validate_plan
from areal_sglang import hooks
from areal_sglang.hooks import areal_declare_backends, areal_validate_parallelism

DENSE = ModelInfo(path="dense", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32)
MOE = ModelInfo(path="moe", num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, num_experts=64)


def validate(text: str, model: ModelInfo | None = DENSE):
    return validate_plan(areal_validate_parallelism, text, model)


def test_declaration():
    assert declared(areal_declare_backends) == ("sglang", "inference", "dtpe", ("gpu",))


def test_hook_module_registers_cleanly():
    assert registered_hooks(hooks, "sglang") == ([], ["areal_declare_backends", "areal_validate_config",
                                                    "areal_validate_parallelism"])


@pytest.mark.parametrize(
    ("text", "model"),
    [
        ("sglang:d8", DENSE),
        ("sglang:d2t8", DENSE),
        ("sglang:t16", DENSE),  # 8 kv heads, each replicated on 2 ranks
        ("sglang:p4t2", DENSE),
        ("sglang:d2t8e8", MOE),
        ("sglang:t8e2", MOE),
        ("sglang:t6p5e3", None),  # unknown model: only e | t is checked
    ],
)
def test_valid_plans(text, model):
    assert validate(text, model) == []


def test_tensor_must_divide_heads():
    (problem,) = validate("sglang:t12")
    assert problem.code == "sglang.tensor-heads"
    assert problem.key == "allocation"
    assert "'sglang:t12'" in problem.message
    assert "t12" in problem.message and "32 attention heads" in problem.message
    assert "8 key-value heads" in problem.message
    assert problem.hint == "choose t from 1, 2, 4, 8, 16, 32, e.g. 'sglang:t8'"


def test_pipeline_must_divide_layers():
    (problem,) = validate("sglang:d2p3")
    assert problem.code == "sglang.pipeline-layers"
    assert "'sglang:d2p3'" in problem.message and "p3" in problem.message and "32 layers" in problem.message
    assert problem.hint == "choose p from 1, 2, 4, 8, 16, 32"


def test_expert_parallel_needs_moe():
    (problem,) = validate("sglang:t4e4", DENSE)
    assert problem.code == "sglang.expert-not-moe"
    assert "'sglang:t4e4'" in problem.message and "e4" in problem.message


def test_expert_parallel_must_divide_experts():
    model = ModelInfo(path="moe", num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, num_experts=60)
    (problem,) = validate("sglang:t8e8", model)
    assert problem.code == "sglang.expert-count"
    assert "e8" in problem.message and "60 experts" in problem.message


def test_expert_parallel_lives_inside_tensor_parallel():
    (problem,) = validate("sglang:d4t2e4", MOE)
    assert problem.code == "sglang.expert-tensor"
    assert "'sglang:d4t2e4'" in problem.message
    assert "e4" in problem.message and "t2" in problem.message
    assert problem.hint == "choose e from 1, 2, or raise t to a multiple of e4"


def test_every_problem_reported_at_once():
    problems = validate("sglang:t12p3e8", DENSE)
    assert codes(problems) == [
        "sglang.tensor-heads",
        "sglang.pipeline-layers",
        "sglang.expert-tensor",
        "sglang.expert-not-moe",
    ]


def test_only_sglang_components_are_judged():
    assert validate("vllm:t12p3+sglang:d2") == []


def test_core_rejects_cpu_and_undeclared_dimensions():
    backends = [*areal_declare_backends(), TRAINER]
    assert core_problems("sglang:d2p2t2e2+trainer:d4", *backends) == []
    problems = core_problems("sglang:d2c2+trainer:d4", *backends)
    assert codes(problems) == ["core.unsupported-dimension"]
    assert "c2" in problems[0].message
    problems = core_problems("sglang:cpu+trainer:d1@cpu", *backends)
    assert codes(problems) == ["core.unsupported-device"]
    assert "'sglang:cpu'" in problems[0].message


def test_attached_servers_must_be_host_port():
    config = RunConfig()
    config.rollout.extra = {"addresses": ["gpu-node-1"]}
    (problem,) = validate_plan(areal_validate_parallelism, "sglang:d1", None, config)
    assert (problem.code, problem.key) == ("sglang.addresses", "rollout.addresses")
    assert "'gpu-node-1': not host:port" in problem.message
