"""Plan rules of the megatron backend, called directly as the hooks would be."""

from __future__ import annotations

import pytest

from areal_core.config.model_info import ModelInfo
from areal_core.config.schema import RunConfig
from areal_core.testing.plans import GEN, codes, core_problems, declared, registered_hooks, validate_plan
from areal_megatron import hooks
from areal_megatron.hooks import areal_declare_backends, areal_validate_parallelism

DENSE = ModelInfo(path="dense", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=24)
MOE = ModelInfo(
    path="moe", num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, num_experts=64
)


def config(vpp=None, dtype="float32") -> RunConfig:
    cfg = RunConfig()
    cfg.model.dtype = dtype  # what megatron builds on CPU (the CPU rules are tested below)
    if vpp is not None:
        cfg.actor.extra["virtual_pipeline_size"] = vpp
    return cfg


def validate(text: str, model: ModelInfo | None = DENSE, vpp=None):
    return validate_plan(areal_validate_parallelism, text, model, config(vpp))


def planned(problems):
    """The problems of the plan rules, without the engine's 'not built yet' refusal."""
    return [p for p in problems if p.code != "megatron.not-built"]


def test_declaration():
    assert declared(areal_declare_backends) == ("megatron", "train", "dptce", ("gpu", "cpu"))


def test_hook_module_registers_cleanly():
    assert registered_hooks(hooks, "megatron") == ([], ["areal_declare_backends", "areal_validate_parallelism"])


@pytest.mark.parametrize(
    ("text", "model", "vpp"),
    [
        ("megatron:d8", DENSE, None),
        ("megatron:d2p4t8", DENSE, None),
        ("megatron:p4t2c2", DENSE, 3),  # 24 layers = 4 stages x 3 chunks x 2
        ("megatron:p2", DENSE, 12),
        ("megatron:d4t2e4", MOE, None),  # stage of 8 ranks, e4 x t2 = 8
        ("megatron:d8p2e8", MOE, 2),
        ("megatron:d2p3t7e2", None, 5),  # unknown model: only plan-shape rules
        ("megatron[ref]:d2", DENSE, 4),  # vpp configures the actor only
    ],
)
def test_valid_plans(text, model, vpp):
    assert planned(validate(text, model, vpp)) == []


def test_pipeline_and_virtual_pipeline_are_built():
    assert validate("megatron:d2t4") == []
    assert validate("megatron:p2@cpu") == []
    assert validate("megatron:d2p2t2", vpp=3) == []  # 24 layers = 2 stages x 3 chunks x 4


def test_context_and_expert_parallel_are_refused_with_the_reason_and_the_fix():
    (problem,) = validate("megatron:d2p2t2c2@cpu")
    assert problem.code == "megatron.not-built" and problem.key == "allocation"
    assert problem.message.startswith("'megatron:d2p2t2c2@cpu': c2 is not built")
    assert "Transformer Engine's attention, which needs a GPU" in problem.message and "fsdp" in problem.message
    assert problem.hint == "use d, t and p only on the same 16 devices, e.g. 'megatron:d4p2t2'"
    (problem,) = validate("megatron:d4t2e4", MOE)
    assert problem.code == "megatron.not-built" and "e4 is not built" in problem.message
    assert "dense Llama / Qwen2 models only" in problem.message
    assert problem.hint == "use d, t and p only on the same 8 devices, e.g. 'megatron:d4t2'"  # e shares d's ranks


def test_tensor_must_divide_heads():
    (problem,) = validate("megatron:t16")
    assert problem.code == "megatron.tensor-heads"
    assert "'megatron:t16'" in problem.message and "t16" in problem.message
    assert "32 attention heads" in problem.message and "8 key-value heads" in problem.message
    assert problem.hint == "choose t from 1, 2, 4, 8, e.g. 'megatron:t8'"


def test_pipeline_must_divide_layers():
    (problem,) = planned(validate("megatron:d2p5"))
    assert problem.code == "megatron.pipeline-layers"
    assert "'megatron:d2p5'" in problem.message
    assert "p5" in problem.message and "24 layers" in problem.message
    assert problem.hint == "choose p from 1, 2, 3, 4, 6, 8, 12, 24"


def test_virtual_pipeline_needs_pipeline():
    (problem,) = validate("megatron:d4", vpp=2)
    assert problem.code == "megatron.virtual-pipeline-needs-pipeline"
    assert problem.key == "actor.virtual_pipeline_size"
    assert "'megatron:d4'" in problem.message and "virtual_pipeline_size=2" in problem.message


def test_virtual_pipeline_must_divide_layers():
    (problem,) = planned(validate("megatron:p4", vpp=4))  # 24 layers / (4 x 4) is not whole
    assert problem.code == "megatron.virtual-pipeline-layers"
    assert "p4" in problem.message and "4 = 16 chunks" in problem.message
    assert "24 layers" in problem.message
    assert problem.hint == "set actor.virtual_pipeline_size to one of 1, 2, 3, 6"


def test_pipeline_layers_reported_once_with_virtual_pipeline():
    # p5 does not divide 24, so p5 x vpp cannot either: one problem, not two.
    assert codes(planned(validate("megatron:p5", vpp=2))) == ["megatron.pipeline-layers"]


@pytest.mark.parametrize("vpp", [0, -1, "2", 1.5, True])
def test_virtual_pipeline_size_must_be_a_positive_int(vpp):
    (problem,) = planned(validate("megatron:p2", vpp=vpp))
    assert problem.code == "megatron.virtual-pipeline-size"
    assert problem.key == "actor.virtual_pipeline_size"
    assert repr(vpp) in problem.message


def test_virtual_pipeline_size_ignored_without_megatron_actor():
    assert validate("megatron[ref]:d2", vpp="bad") == []


def test_expert_parallel_needs_moe():
    (problem,) = planned(validate("megatron:d4e2", DENSE))
    assert problem.code == "megatron.expert-not-moe"
    assert "'megatron:d4e2'" in problem.message and "e2" in problem.message
    assert "'dense'" in problem.message


def test_expert_parallel_must_divide_experts():
    model = ModelInfo(path="moe", num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, num_experts=60)
    (problem,) = planned(validate("megatron:d8e8", model))
    assert problem.code == "megatron.expert-count"
    assert "e8" in problem.message and "60 experts" in problem.message
    assert problem.hint.startswith("choose e from 1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60")


def test_expert_times_tensor_must_divide_stage_ranks():
    (problem,) = planned(validate("megatron:d3t2e2", MOE))  # stage of 6 ranks, e2 x t2 = 4
    assert problem.code == "megatron.expert-placement"
    assert "'megatron:d3t2e2'" in problem.message
    assert "e2" in problem.message and "t2 = 4" in problem.message and "6 ranks" in problem.message
    assert "choose e from 1, 3" in problem.hint


def test_expert_placement_checked_without_a_model():
    assert codes(planned(validate("megatron:d2p2e4", None))) == ["megatron.expert-placement"]


def test_every_problem_reported_at_once():
    problems = validate("megatron:d3p5t16e2", DENSE, vpp=2)
    assert codes(problems) == [
        "megatron.tensor-heads",
        "megatron.pipeline-layers",
        "megatron.expert-not-moe",
        "megatron.expert-placement",
        "megatron.not-built",
    ]


def test_only_megatron_components_are_judged():
    assert validate("fsdp:p5t16e3+megatron:d2", DENSE, vpp=1) == []


def test_core_rejects_undeclared_dimensions_and_accepts_all_five():
    backends = [*areal_declare_backends(), GEN]
    assert core_problems("gen:d1+megatron:d2p2t2c2e2", *backends) == []
    problems = core_problems("gen:d1@cpu+megatron:t2@cpu", *backends)
    assert problems == []
    problems = core_problems("gen:d1+megatron:d2+megatron:d2", *backends)
    assert codes(problems) == ["core.duplicate-role"]


# ---------------------------------------------------------------------- what the engine refuses, named by the check
def test_on_cpu_the_actor_needs_float32_and_no_recomputation():
    bf16 = validate_plan(areal_validate_parallelism, "megatron:d1@cpu", DENSE, config(dtype="bfloat16"))
    assert codes(bf16) == ["megatron.cpu-dtype"] and bf16[0].key == "model.dtype"
    assert "set model.dtype=float32 for megatron on CPU" in bf16[0].hint
    assert validate_plan(areal_validate_parallelism, "megatron:d1", DENSE, config(dtype="bfloat16")) == []  # GPU
    assert validate_plan(areal_validate_parallelism, "megatron[ref]:d1@cpu", DENSE, config(dtype="bfloat16")) == []
    cfg = config()
    cfg.actor.gradient_checkpointing = True
    (recompute,) = validate_plan(areal_validate_parallelism, "megatron:d1@cpu", DENSE, cfg)
    assert recompute.code == "megatron.cpu-recompute" and recompute.key == "actor.gradient_checkpointing"
    assert validate_plan(areal_validate_parallelism, "megatron:d1", DENSE, cfg) == []


@pytest.mark.parametrize(("model_type", "raw", "says"), [
    ("mistral", {}, "a mistral model; the megatron backend converts llama, qwen2 only"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu', not silu"),
    ("llama", {"attention_bias": True}, "a Llama with attention_bias / mlp_bias"),
    ("qwen2", {"use_sliding_window": True}, "a Qwen2 with use_sliding_window"),
])
def test_architectures_the_conversion_does_not_carry_are_named(model_type, raw, says):
    model = ModelInfo(path="m", model_type=model_type, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=24, raw={"model_type": model_type, **raw})
    (problem,) = validate("megatron:d8", model)
    assert problem.code == "megatron.architecture" and says in problem.message and problem.key == "model.path"
    assert validate("megatron:d8", ModelInfo(path="m", model_type="qwen2", num_attention_heads=32,
                                             num_key_value_heads=8, num_hidden_layers=24)) == []
