"""Tests for the plan rules shared by engine plugins (areal_core.parallelism_rules)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.config.allocation import parse_allocation
from areal_core.config.model_info import ModelInfo
from areal_core.parallelism_rules import divisors, experts_problem, heads_problem, layers_problem


def component(text: str):
    return parse_allocation(text).components[0]


def model(heads: int | None, kv: int | None = None) -> ModelInfo:
    return ModelInfo(path="m", num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=4)


# ------------------------------------------------------------------ divisors


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, [1]), (2, [1, 2]), (12, [1, 2, 3, 4, 6, 12]), (16, [1, 2, 4, 8, 16]), (7, [1, 7]), (0, []), (-4, [])],
)
def test_divisors(n, expected):
    assert divisors(n) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=5000))
def test_divisors_match_brute_force(n):
    assert divisors(n) == [k for k in range(1, n + 1) if n % k == 0]


# ------------------------------------------------------------- heads_problem


def test_heads_fit_gives_none():
    assert heads_problem("x.tensor-heads", component("fsdp:t4"), 4, model(32, 8)) is None


def test_t1_or_unknown_model_or_heads_gives_none():
    comp = component("fsdp:d2")
    assert heads_problem("x.tensor-heads", comp, 1, model(7, 7)) is None
    assert heads_problem("x.tensor-heads", component("fsdp:t3"), 3, None) is None
    assert heads_problem("x.tensor-heads", component("fsdp:t3"), 3, model(None)) is None


def test_heads_not_divisible():
    comp = component("fsdp:d2t8")
    problem = heads_problem("fsdp.tensor-heads", comp, 8, model(12, 12))
    assert problem is not None
    assert problem.code == "fsdp.tensor-heads"
    assert problem.key == "allocation"
    assert "'fsdp:d2t8'" in problem.message
    assert "t8" in problem.message and "12 attention heads" in problem.message
    assert problem.hint == "choose t from 1, 2, 3, 4, 6, 12, e.g. 'fsdp:d2t6'"


def test_kv_heads_constrain_t_too():
    problem = heads_problem("fsdp.tensor-heads", component("fsdp:t16"), 16, model(32, 8))
    assert problem is not None
    assert "32 attention heads" in problem.message and "8 key-value heads" in problem.message
    assert problem.hint == "choose t from 1, 2, 4, 8, e.g. 'fsdp:t8'"


def test_missing_kv_heads_means_multi_head_attention():
    assert heads_problem("x.h", component("fsdp:t16"), 16, model(32, None)) is None


def test_kv_replication_accepts_multiples_of_kv_heads():
    comp = component("vllm:t16")
    assert heads_problem("vllm.tensor-heads", comp, 16, model(32, 8), kv_replication=True) is None
    problem = heads_problem("vllm.tensor-heads", component("vllm:t12"), 12, model(24, 8), kv_replication=True)
    assert problem is not None
    assert "divide or be a multiple of its 8 key-value heads" in problem.message
    # divisors of 24 that divide 8 or are multiples of 8
    assert problem.hint == "choose t from 1, 2, 4, 8, 24, e.g. 'vllm:t8'"


# ------------------------------------------------------------ layers_problem


def test_layers_fit_or_unknown_gives_none():
    assert layers_problem("x.pipeline-layers", component("vllm:p4"), 4, model(8)) is None
    assert layers_problem("x.pipeline-layers", component("vllm:d2"), 1, model(8)) is None
    assert layers_problem("x.pipeline-layers", component("vllm:p3"), 3, None) is None
    unknown = ModelInfo(path="m", num_attention_heads=8)
    assert layers_problem("x.pipeline-layers", component("vllm:p3"), 3, unknown) is None


def test_layers_not_divisible():
    problem = layers_problem("vllm.pipeline-layers", component("vllm:d2p3"), 3, model(8))
    assert problem is not None
    assert problem.code == "vllm.pipeline-layers"
    assert problem.key == "allocation"
    assert problem.message == "'vllm:d2p3': pipeline size p3 must divide the model's 4 layers."
    assert problem.hint == "choose p from 1, 2, 4"


# ----------------------------------------------------------- experts_problem

MOE = ModelInfo(path="moe", num_attention_heads=8, num_hidden_layers=4, num_experts=60)


def test_experts_fit_or_unknown_gives_none():
    assert experts_problem("x", component("sglang:t4e4"), 4, MOE) is None
    assert experts_problem("x", component("sglang:t4"), 1, model(8)) is None
    assert experts_problem("x", component("sglang:t4e4"), 4, None) is None


def test_experts_need_moe():
    problem = experts_problem("sglang", component("sglang:t4e4"), 4, model(8))
    assert problem is not None
    assert problem.code == "sglang.expert-not-moe"
    assert "'sglang:t4e4'" in problem.message and "e4" in problem.message and "'m'" in problem.message


def test_experts_must_divide_unless_told_otherwise():
    problem = experts_problem("sglang", component("sglang:t8e8"), 8, MOE)
    assert problem is not None
    assert problem.code == "sglang.expert-count"
    assert "e8" in problem.message and "60 experts" in problem.message
    assert problem.hint == "choose e from 1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60"
    assert experts_problem("vllm", component("vllm:t8e8"), 8, MOE, divide_experts=False) is None
