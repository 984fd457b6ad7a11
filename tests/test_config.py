"""Config loading and validation: every problem at once, each naming key, value and fix."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.config.load import load_config
from areal_core.config.schema import RunConfig
from areal_core.config.validate import validate_run
from areal_core.plugins import get_plugin_manager
from areal_core.problems import ProblemsError


def texts(problems):
    return [str(p) for p in problems]


def test_defaults_have_no_type_or_range_problems():
    config, problems = load_config(None, [])
    assert problems == []
    expected = RunConfig()
    expected.model.dtype = config.model.dtype  # "auto" is resolved for this machine
    assert config == expected and config.model.dtype in ("float32", "bfloat16")


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  optimizer:\n    lr: 1e-5\nrollout:\n  group_size: 4\n")
    config, problems = load_config(str(path), ["rollout.group_size=16", "trial=7"])
    assert problems == []
    assert config.actor.optimizer.lr == 1e-5  # PyYAML alone would read '1e-5' as a string
    assert config.rollout.group_size == 16
    assert config.trial == "7"


def test_unknown_key_names_the_path_and_the_closest_key():
    _, problems = load_config(None, ["trainer.totl_steps=3"])
    assert texts(problems) == [
        "[core.unknown-key] trainer.totl_steps: unknown key\n    fix: did you mean trainer.total_steps?"
    ]


def test_wrong_type_and_out_of_range_and_bad_choice_word_for_word():
    _, problems = load_config(None, [
        "rollout.group_size=many", "actor.optimizer.lr=-1", "model.dtype=fp16", "rollout.sampling=3",
    ])
    assert texts(problems) == [
        "[core.type] rollout.group_size: 'many' (str) is not an integer\n"
        "    fix: set rollout.group_size to an integer",
        "[core.type] rollout.sampling: 3 (int) is not a mapping\n"
        "    fix: write rollout.sampling as a section of keys",
        "[core.range] actor.optimizer.lr: -1.0 is out of range; it must be > 0.0\n"
        "    fix: set actor.optimizer.lr to a value > 0.0",
        "[core.choice] model.dtype: 'fp16' is not allowed; choose one of: auto, float32, bfloat16\n"
        "    fix: set model.dtype=auto",
    ]


def test_override_without_equals_is_a_problem_not_a_traceback():
    _, problems = load_config(None, ["actor.optimizer.lr"])
    assert texts(problems) == [
        "[core.override] actor.optimizer.lr: cannot read override 'actor.optimizer.lr'\n"
        "    fix: write overrides as dotted.key=value, e.g. actor.optimizer.lr=1e-5"
    ]


def test_invalid_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("actor:\n  backend: [fsdp\n")
    with pytest.raises(ProblemsError) as err:
        load_config(str(path), [])
    assert str(err.value).startswith(f"1 problem in {path}:\n  1. [core.yaml] {path} is not valid YAML:")


def test_missing_file():
    with pytest.raises(ProblemsError, match=r"\[core.config-file\] config nope.yaml does not exist"):
        load_config("nope.yaml", [])


def test_three_independent_mistakes_are_all_reported(double_stack, tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text("rollout:\n  max_head_offpolicyness: -1\nactor:\n  optimzer: {lr: 1e-5}\n"
                    "allocation: 'infer_double:cpu+train_double:d2p2@cpu'\n")
    run = validate_run(str(path), double_stack, manager=get_plugin_manager(refresh=True))
    assert texts(run.problems) == [
        "[core.range] rollout.max_head_offpolicyness: -1 is out of range; it must be >= 0\n"
        "    fix: set rollout.max_head_offpolicyness to a value >= 0",
        "[core.unknown-key] actor.optimzer: unknown key: neither the core nor train engine "
        "'train_double' declares it\n    fix: did you mean actor.optimizer?",
        "[core.unsupported-dimension] allocation: 'train_double:d2p2@cpu': train_double does not "
        "support pipeline parallelism (p2); it supports d (data), t (tensor).\n"
        "    fix: remove p2 or choose a backend that supports it",
    ]


def test_component_keys_are_typed_by_the_components_config_class(double_stack):
    run = validate_run(None, [*double_stack, "algorithm.eps_clip=0.3", "algorithm.group_nrom=false"],
                       manager=get_plugin_manager(refresh=True))
    assert texts(run.problems) == [
        "[core.unknown-key] algorithm.group_nrom: unknown key: neither the core nor algorithm "
        "'algo_double' declares it\n    fix: did you mean algorithm.group_norm?"
    ]
    assert run.options["algorithm"].eps_clip == 0.3
    assert run.resolved_dict()["algorithm"]["extra"] == {"eps_clip": 0.3, "group_norm": True}


def test_allocation_must_agree_with_the_configured_backends(double_stack):
    run = validate_run(None, [*double_stack, "actor.backend=fsdp", "allocation=infer_double:cpu+train_double:d1@cpu"],
                       manager=get_plugin_manager(refresh=True))
    codes = [p.code for p in run.problems]
    assert "core.backend-mismatch" in codes
    mismatch = next(p for p in run.problems if p.code == "core.backend-mismatch")
    assert mismatch.message == ("the allocation places 'train_double:cpu' as actor, but actor.backend is 'fsdp'")


def test_valid_stack_has_no_problems(double_stack):
    run = validate_run(None, double_stack, manager=get_plugin_manager(refresh=True))
    assert run.problems == []
    assert str(run.allocation) == "infer_double:cpu+train_double:cpu"


KEYS = ["experiment", "trial", "allocation", "actor.backend", "actor.optimizer.lr", "actor.optimizer.lr_schedule",
        "rollout.group_size", "rollout.sampling.top_p", "rollout.sampling.stop", "model.dtype", "trainer",
        "trainer.total_steps", "actor.mb_max_tokens", "bogus", "actor.optimizer", "rollout.extra.x"]
VALUES = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.booleans(), st.none(),
                   st.text(string.printable, max_size=12), st.lists(st.integers(), max_size=3))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
def test_loader_never_crashes_on_any_values(values):
    import yaml

    overrides = []
    for key, value in values.items():  # each value written as YAML flow text, as a user would type it
        overrides.append(f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
                         if value is not None else f"{key}=")
    try:
        config, problems = load_config(None, overrides)
    except ProblemsError:
        return
    assert isinstance(config, RunConfig)
    for p in problems:
        assert p.code.startswith("core.") and p.message


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(string.printable, max_size=30), max_size=4))
def test_arbitrary_override_text_never_crashes(overrides):
    try:
        load_config(None, overrides)
    except ProblemsError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="fsdpvlmgc:dtpce0123456789+|[]@ ", max_size=30))
def test_validation_never_crashes_on_any_allocation(allocation):
    run = validate_run(None, [f"allocation='{allocation}'"], with_components=False)
    assert all(p.code and p.message for p in run.problems)


def test_docs_config_page_lists_every_key_as_the_schema_says():
    from pathlib import Path

    from areal_core.config.describe import key_table

    page = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    assert key_table() in page, "docs/config.md is stale: paste the output of areal_core.config.describe.key_table()"


def test_auto_dtype_is_resolved_for_this_machine(monkeypatch):
    from areal_core.config import dtype

    monkeypatch.setattr(dtype, "has_gpu", lambda: False)
    assert dtype.cpu_has_bf16("flags : fpu avx512f avx512_bf16 amx_tile") is True
    assert dtype.cpu_has_bf16("flags : fpu avx512f") is False
    monkeypatch.setattr(dtype, "cpu_has_bf16", lambda cpuinfo=None: False)
    assert load_config(None, [])[0].model.dtype == "float32"
    assert load_config(None, ["model.dtype=bfloat16"])[0].model.dtype == "bfloat16"
    monkeypatch.setattr(dtype, "has_gpu", lambda: True)
    assert load_config(None, [])[0].model.dtype == "bfloat16"
