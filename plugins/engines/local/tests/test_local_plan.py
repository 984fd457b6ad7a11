"""The local backend's declaration, and the core rules it relies on."""

from __future__ import annotations

import pytest

from areal_core.testing.plans import TRAINER, core_problems, declared, registered_hooks
from areal_local import hooks
from areal_local.hooks import areal_declare_backends


def plan_problems(text: str):
    return core_problems(text, *areal_declare_backends(), TRAINER)


def test_declaration():
    assert declared(areal_declare_backends) == ("local", "inference", "d", ("cpu",))
    (support,) = areal_declare_backends()
    assert support.description == "embedded CPU generator, one process per d"


def test_hook_module_declares_the_backend_and_provides_the_demo_model():
    warnings, names = registered_hooks(hooks, "local")
    assert warnings == []
    assert sorted(names) == ["areal_declare_backends", "areal_resolve_model", "areal_validate_parallelism"]


@pytest.mark.parametrize("text", ["local:cpu+trainer:d1@cpu", "local:d4@cpu+trainer:d2@cpu", "local:d2@cpu|trainer:d2@cpu"])
def test_valid_plans(text):
    assert plan_problems(text) == []


@pytest.mark.parametrize(
    ("text", "dims"),
    [("local:d2t2@cpu+trainer:d1@cpu", ["t2"]), ("local:p2e2@cpu+trainer:d1@cpu", ["p2", "e2"])],
)
def test_core_rejects_other_dimensions(text, dims):
    problems = plan_problems(text)
    assert [p.code for p in problems] == ["core.unsupported-dimension"] * len(dims)
    for problem, dim in zip(problems, dims):
        assert dim in problem.message


def test_core_rejects_gpu():
    (problem,) = plan_problems("local:d2+trainer:d1@cpu")
    assert problem.code == "core.unsupported-device"
    assert "'local:d2'" in problem.message
    assert "@cpu" in problem.hint
