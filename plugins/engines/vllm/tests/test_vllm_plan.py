"""Plan rules of the vllm backend, called directly as the hooks would be."""

from __future__ import annotations

import pytest

from areal_core.config.model_info import ModelInfo
from areal_core.config.schema import RunConfig
from areal_core.testing.plans import TRAINER, codes, core_problems, declared, registered_hooks, validate_plan
from areal_vllm import hooks
from areal_vllm.hooks import areal_declare_backends, areal_validate_parallelism

# 28 query heads, 4 key-value heads, 28 layers (a Qwen2.5-7B shape).
DENSE = ModelInfo(path="dense", num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28)
MOE = ModelInfo(path="moe", num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, num_experts=60)


def validate(text: str, model: ModelInfo | None = DENSE):
    return validate_plan(areal_validate_parallelism, text, model)


def test_declaration():
    assert declared(areal_declare_backends) == ("vllm", "inference", "dtpe", ("gpu", "cpu"))


def test_hook_module_registers_cleanly():
    assert registered_hooks(hooks, "vllm") == ([], ["areal_declare_backends", "areal_validate_config",
                                                  "areal_validate_parallelism"])


@pytest.mark.parametrize(
    ("text", "model"),
    [
        ("vllm:d8", DENSE),
        ("vllm:d2t4", DENSE),
        ("vllm:t2p7", DENSE),
        ("vllm:t28", DENSE),  # 4 kv heads, each replicated on 7 ranks
        ("vllm:d2t4e8", MOE),  # 60 experts over 8 ranks: vLLM spreads them unevenly
        ("vllm:d4@cpu", DENSE),
        ("vllm:cpu", DENSE),
        ("vllm:t3p5e2", None),  # unknown model: nothing to check on gpu
        ("fsdp:d8|vllm:d8", DENSE),
    ],
)
def test_valid_plans(text, model):
    assert validate(text, model) == []


def test_tensor_must_divide_heads():
    (problem,) = validate("vllm:d2t8")
    assert problem.code == "vllm.tensor-heads"
    assert problem.key == "allocation"
    assert "'vllm:d2t8'" in problem.message
    assert "t8" in problem.message and "28 attention heads" in problem.message
    assert "4 key-value heads" in problem.message
    # the divisors of the head count that also split or replicate the kv heads
    assert problem.hint == "choose t from 1, 2, 4, 28, e.g. 'vllm:d2t4'"


def test_tensor_between_kv_divisors_and_multiples_is_refused():
    model = ModelInfo(path="m", num_attention_heads=24, num_key_value_heads=8, num_hidden_layers=24)
    (problem,) = validate("vllm:t12", model)  # 12 neither divides 8 nor is a multiple of it
    assert problem.code == "vllm.tensor-heads"
    assert problem.hint == "choose t from 1, 2, 4, 8, 24, e.g. 'vllm:t8'"


def test_pipeline_must_divide_layers():
    (problem,) = validate("vllm:p3")
    assert problem.code == "vllm.pipeline-layers"
    assert "'vllm:p3'" in problem.message and "p3" in problem.message and "28 layers" in problem.message
    assert problem.hint == "choose p from 1, 2, 4, 7, 14, 28"


def test_expert_parallel_needs_moe():
    (problem,) = validate("vllm:t4e4", DENSE)
    assert problem.code == "vllm.expert-not-moe"
    assert "'vllm:t4e4'" in problem.message and "e4" in problem.message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:t2@cpu", ["vllm.cpu-tensor"]),
        ("vllm:p2@cpu", ["vllm.cpu-pipeline"]),
        ("vllm:e2@cpu", ["vllm.cpu-expert"]),
        ("vllm:d2p2t2@cpu", ["vllm.cpu-pipeline", "vllm.cpu-tensor"]),
    ],
)
def test_cpu_runs_one_process_per_server(text, expected):
    problems = validate(text)
    assert codes(problems) == expected
    for problem in problems:
        assert f"'{text}'" in problem.message


def test_cpu_message_names_the_value():
    (problem,) = validate("vllm:t4@cpu")
    assert "t4" in problem.message
    assert problem.hint.startswith("scale with data parallel (more servers) instead, e.g. 'vllm:d4@cpu'")
    # every refused dimension is folded into d in the suggestion
    assert all("'vllm:d8@cpu'" in p.hint for p in validate("vllm:d2p2t2e2@cpu"))


def test_every_problem_reported_at_once():
    problems = validate("vllm:t8p3e2", DENSE)
    assert codes(problems) == ["vllm.tensor-heads", "vllm.pipeline-layers", "vllm.expert-not-moe"]


def test_only_vllm_components_are_judged():
    assert validate("sglang:t8p3+vllm:d2") == []


def test_core_rejects_undeclared_dimensions():
    backends = [*areal_declare_backends(), TRAINER]
    assert core_problems("vllm:d2t2p2e2+trainer:d4", *backends) == []
    problems = core_problems("vllm:d2c4+trainer:d4", *backends)
    assert codes(problems) == ["core.unsupported-dimension"]
    assert "c4" in problems[0].message and "'vllm:d2c4'" in problems[0].message


def test_attached_servers_must_match_the_allocation():
    config = RunConfig()
    config.rollout.extra = {"addresses": ["127.0.0.1:8001"]}
    (problem,) = validate_plan(areal_validate_parallelism, "vllm:d2@cpu", DENSE, config)
    assert (problem.code, problem.key) == ("vllm.addresses", "rollout.addresses")
    assert "1 server(s) given, but the allocation places 2" in problem.message
    config.rollout.extra = {"addresses": ["127.0.0.1:8001", "127.0.0.1:8002"]}
    assert validate_plan(areal_validate_parallelism, "vllm:d2@cpu", DENSE, config) == []
